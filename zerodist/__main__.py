from zerodist.cli.main import run_and_exit

run_and_exit()
