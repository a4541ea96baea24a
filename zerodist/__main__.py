from zerodist.cli.main import main

raise SystemExit(main())
