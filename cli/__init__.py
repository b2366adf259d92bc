"""What run.py and bench.py share: flags and errors, prompts, printed text; bench.py's answer files
and figures."""
import signal
import sys


def interrupt_quietly():
    """From the first line of run.py and bench.py, before torch imports (a second or more): Ctrl-C
    ends with one line and status 130, not a traceback through the imports. one_line_errors hands
    SIGINT back to Python's KeyboardInterrupt once main runs."""
    def interrupted(*_):
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    signal.signal(signal.SIGINT, interrupted)
