"""``hftk bench``'s command line in one process: a bad option is one clear line, every bench prints its help."""

from __future__ import annotations

import pytest

from hftk.bench.cli import BENCHES


@pytest.mark.parametrize("args,field", [
    (["bench", "nope"], "bench"),
    (["bench", "scaling", "--repeats", "x"], "--repeats"),
    (["bench", "scaling", "--bogus", "1"], "--bogus"),
    (["bench", "all", "--set", "scaling.bogus=1"], "--set scaling.bogus"),
    (["bench", "all", "--only", "scaling,nope"], "--only"),
    (["bench", "batch", "--global_batch", "7", "--nproc", "2"], "bench.global_batch"),
    (["bench", "scaling", "--", "--blok_size", "64"], "--blok_size"),
    (["bench", "data", "--min_words", "10", "--max_words", "50"], "--max_words"),
])
def test_bad_bench_options_are_one_clear_line(args, field, tmp_path, capsys):
    from hftk.cli import main

    assert main([*args[:2], "--out", str(tmp_path / "r"), *args[2:]] if args[1] != "nope" else args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and field in err[0] and "Fix:" in err[0], err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_prints_its_help(name, capsys):
    """``hftk bench NAME --help`` lists the bench's options (argparse formats help text with %: a
    bare one in an option's help was a traceback)."""
    from hftk.cli import main

    with pytest.raises(SystemExit) as done:
        main(["bench", name, "--help"])
    assert done.value.code == 0 and "--timeout" in capsys.readouterr().out
