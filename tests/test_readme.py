"""The README's reading path of the reference: the lengths and line ranges it names are the files'."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lines_of(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read().splitlines()


def test_the_reading_path_names_the_files_lengths_and_ranges():
    """Each `file.py` (N lines) is the file's length as wc -l counts it, the total is the reading
    path's (wfd.py, kv.py, models.py, layers/*.py), and the ranges end where the code they name
    ends: the module docstrings, models.py's three calls and `_layers`."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    path = ["wfd.py", "kv.py", "models.py"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "layers", "*.py")))
    named = re.findall(r"`([\w/]+\.py)` \((\d+)(?: lines)?\)", text)
    assert {name for name, _ in named} >= {"wfd.py", "kv.py", "models.py", "layers/noise.py",
                                           "layers/transformer.py"}
    for name, n in named:
        assert int(n) == len(lines_of(name)), name
    total = re.search(r"three files and `layers/`, ([\d,]+) lines;", text).group(1)
    assert int(total.replace(",", "")) == sum(len(lines_of(p)) for p in path)
    for name in ("wfd.py", "kv.py", "models.py"):
        end = int(re.search(rf"\| `{name}` \(\d+(?: lines)?\) \| 1-(\d+):", text).group(1))
        lines = lines_of(name)
        assert lines[0].startswith('"""') and lines[end - 1] == '"""', name
    calls = re.search(r"the three calls `LoopedLM.P`, `R`, `C` \((\d+)-(\d+)\)", text).groups()
    layers = re.search(r"`_layers` \((\d+)-(\d+)\)", text).groups()
    (start, end), (layers_start, layers_end) = map(int, calls), map(int, layers)
    lines = lines_of("models.py")
    assert lines[start - 1].startswith("    # -- the three calls"), lines[start - 1]
    assert lines[end - 1] == "        return self.head(self.c_state(s, e, Call(pos, None, cache)))"
    assert lines[end] == "" and lines[end + 1].startswith("    def p_body"), lines[end + 1]
    assert lines[layers_start - 1].startswith("    def _layers("), lines[layers_start - 1]
    assert lines[layers_end - 1] == "        return x"
    assert lines[layers_end + 1].startswith("    def clock_table"), lines[layers_end + 1]
