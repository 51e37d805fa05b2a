"""`python -m specpipe ...`: what `python run.py ...` runs in a checkout."""
from specpipe.cli import main

main()
