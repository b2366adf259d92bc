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
        end = int(re.search(rf"\| `{name}` \(\d+(?: lines)?\) \| 1-(\d+) \(", text).group(1))
        lines = lines_of(name)
        assert lines[0].startswith('"""') and lines[end - 1] == '"""', name
    calls = re.search(r"the three calls \((\d+)-(\d+)\): `LoopedLM.P`, `R`, `C`", text).groups()
    layers = re.search(r"`_layers` \((\d+)-(\d+)\)", text).groups()
    (start, end), (layers_start, layers_end) = map(int, calls), map(int, layers)
    lines = lines_of("models.py")
    assert lines[start - 1].startswith("    # -- the three calls"), lines[start - 1]
    assert lines[end - 1] == "        return self.head(self.c_state(s, e, Call(pos, None, cache)))"
    assert lines[end] == "" and lines[end + 1].startswith("    def p_body"), lines[end + 1]
    assert lines[layers_start - 1].startswith("    def _layers("), lines[layers_start - 1]
    assert lines[layers_end - 1] == "        return x"
    assert lines[layers_end + 1].startswith("    def clock_table"), lines[layers_end + 1]


def whole_method(path, start, end, name):
    """Lines start..end (1-based) of `path` are the method `name`, all of it and nothing after."""
    lines = lines_of(path)
    body = lines[start:end]
    return (lines[start - 1].startswith(f"    def {name}(") and lines[end] == ""
            and lines[end + 1].startswith("    def ")
            and all(line == "" or line.startswith("        ") for line in body))


def test_the_batched_call_names_the_lines_of_its_four_places():
    """The README's 'One batched call' bullet names, in each file, the lines of the code that an R
    call runs through: Loop.advance, LoopedLM.R, r_body and _layers, Block.forward's attend line (the table
    names it too), KVCache.attend."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    bullet = re.search(r"- \*\*One batched call\*\*:(.*?)\n- ", text, re.S).group(1)
    advance = re.search(r"`wfd.py` (\d+)-(\d+) \(`Loop.advance`\)", bullet).groups()
    models = re.search(r"`models.py` (\d+)-(\d+) \(`R`\), (\d+)-(\d+) \(`r_body`\) and "
                       r"(\d+)-(\d+) \(`_layers`\)", bullet).groups()
    r, r_body, layers = models[:2], models[2:4], models[4:]
    attend = re.search(r"`kv.py` (\d+)-(\d+) \(`KVCache.attend`\)", bullet).groups()
    assert whole_method("wfd.py", *map(int, advance), "advance")
    assert whole_method("models.py", *map(int, r), "R")
    assert whole_method("models.py", *map(int, r_body), "r_body")
    assert whole_method("models.py", *map(int, layers), "_layers")
    assert whole_method("kv.py", *map(int, attend), "attend")
    line = re.search(r"`layers/transformer.py` (\d+) \(`attend\(q, k, v\)`\)", bullet).group(1)
    table = re.search(r"`attend\(q, k, v\)` \((\d+)\) \|", text).group(1)
    assert line == table
    assert "attend(q, k, v)" in lines_of("layers/transformer.py")[int(line) - 1]


def test_the_reading_table_names_the_line_of_each_definition():
    """In the table's `read` cells, each `name` N (or `name` (N-M)) starts at line N of its file:
    a class or def of that name."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    checked = 0
    for name, cell in re.findall(r"^\| `(\w+\.py)` \([^)]*\) \| (.*?) \|", text, re.M):
        lines = lines_of(name)
        for word, line in re.findall(r"`(?:\w+\.)?(\w+)` \(?(\d+)\b(?!\))", cell):
            assert re.match(rf"\s*(class|def) {word}\b", lines[int(line) - 1]), (name, word, line)
            checked += 1
    assert checked >= 15, checked
