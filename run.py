"""specpipe's command line in a checkout: `python run.py [task=generate|bench] [pipeline=...] [model=...] ...`
(installed: `specpipe ...` or `python -m specpipe ...`)."""
from specpipe.cli import main

if __name__ == "__main__":
    main()
