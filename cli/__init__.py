"""What run.py and bench.py share: flags and errors, prompts, printed text; bench.py's answer files
and figures."""
