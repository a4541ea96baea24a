"""``python -m zerodist.config.docs > docs/config.md`` regenerates the config reference.

The rendering lives in ``markdown.py`` so that importing ``zerodist.config`` does not import
this module (running a module that its package already imported makes runpy warn).
"""

import sys

from zerodist.config.markdown import render_defaults_markdown

if __name__ == "__main__":
    sys.stdout.write(render_defaults_markdown())
