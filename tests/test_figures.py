"""The pages hold the figures of the runs in docs/figures/ (scripts/figures.py): every marked table
is what its JSON files render, and the README quotes no other measured speedup in its prose."""
import importlib.util
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
spec = importlib.util.spec_from_file_location("figures", os.path.join(ROOT, "scripts",
                                                                      "figures.py"))
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)


def test_every_marked_table_is_its_json_rendered():
    pages = figures.pages()
    used = {m[2] for text in pages.values() for m in figures.MARKED.finditer(text)}
    assert {"README.md", "docs/siblings.md", "docs/benchmarks.md",
            "docs/compiling.md"} <= set(pages)
    assert used == set(figures.TABLES)  # every table on a page, every marker a table
    for page, text in pages.items():
        assert figures.rendered(text) == text, (f"{page} differs from docs/figures/: run python "
                                                "scripts/figures.py")


def test_each_json_is_its_commands_run():
    for name in figures.RUNS:
        r = figures.read(name)
        if r is not None:
            assert r["command"] == figures.command(name) and r["run"] == name
            assert {"model name", "CPU family", "model", "flags"} <= r["machine"].keys()
            assert r["date"] and r["torch"] and r["methods"]["ar"]["tok_s"] > 0


def test_the_readmes_prose_quotes_no_other_speedup():
    """Outside its rendered table the README quotes no measured speedup (N.NNx) but the paper's,
    and the CPU is named as lscpu names it (no marketing generation)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = figures.MARKED.sub("", f.read())
    paper = {"2.42x", "3.54x", "4.81x"}
    assert set(re.findall(r"\b\d+\.\d+x\b", text)) <= paper
    for page in figures.PAGES:
        with open(os.path.join(ROOT, page)) as f:
            assert not re.search(r"\bZen ?\d", f.read()), page
