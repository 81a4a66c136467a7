"""--context sink --sink-tokens S --window W: one meaning in generate, chat and serve."""

import pytest

from glassformer.cli import build_parser, main
from glassformer.cli.options import engine_config, sink_policy
from glassformer.model.sink import SinkPolicy


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_flags_make_one_policy(command):
    parse = build_parser().parse_args
    assert sink_policy(parse([command, "--model", "m"])) is None
    args = parse([command, "--model", "m", "--context", "sink", "--window", "64"])
    assert sink_policy(args) == SinkPolicy(4, 64)
    args = parse([command, "--model", "m", "--context", "sink", "--sink-tokens", "0", "--window", "8"])
    assert sink_policy(args) == SinkPolicy(0, 8)
    if command != "chat":
        assert engine_config(args).sink == SinkPolicy(0, 8)


@pytest.mark.parametrize("bad, named", [
    (["--context", "sink"], "--window"),
    (["--window", "8"], "--window"),
    (["--context", "sink", "--window", "0"], "--window"),
    (["--context", "sink", "--window", "8", "--sink-tokens", "-1"], "--sink-tokens"),
    (["--context", "stream"], "--context"),
])
def test_bad_values_are_one_line(bad, named, capsys):
    assert main(["generate", "--model", "never-read", "hi", *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]
