"""A pytest plugin of gpu_check.sh (`-p gpu_check_cases`, scripts/ on PYTHONPATH): each case's
start and end, a line each ("start NODEID", "end NODEID"), written at once to the file
GPU_CHECK_CASES names, so that a step killed by its timeout can name the cases it was running.
pytest -v names a case only as it ends under pytest-xdist, whose controller hears both hooks
from its workers."""
import os

cases = None


def pytest_configure(config):
    global cases
    if not hasattr(config, "workerinput"):  # the controller writes; a worker's are relayed to it
        cases = open(os.environ["GPU_CHECK_CASES"], "a", buffering=1)  # a line at a time


def pytest_runtest_logstart(nodeid):
    if cases:
        print("start", nodeid, file=cases)


def pytest_runtest_logfinish(nodeid):
    if cases:
        print("end", nodeid, file=cases)
