"""The commands' ``--help`` is plain text: no reST markup (double backticks, roles) and no path
that exists only in a checkout of the repository (``docs/``, ``benchmarks/``, ...), since an
installed package has neither; the server's ``--port`` is a TCP port."""

from __future__ import annotations

import re

import pytest

CHECKOUT_ONLY = re.compile(r"\b(docs|benchmarks|tests|ffi|\.ci)/|\.md\b")


def parsers():
    from jax_tokenweave import generate, launch
    from jax_tokenweave.harness import job

    out = {
        "generate": generate.build_parser,
        "launch": launch.build_parser,
        "bench": job.build_parser,
    }
    try:
        from jax_tokenweave import serve as serve
    except ImportError:  # the serve extra is not installed
        return out
    return {**out, "serve": serve.build_parser}


@pytest.mark.parametrize("command", ["generate", "launch", "bench", "serve"])
def test_help_is_plain_text(command):
    build = parsers().get(command)
    if build is None:
        pytest.skip("the serve extra is not installed")
    text = build().format_help()
    assert f"python -m jax_tokenweave.{command}" in text
    assert "``" not in text and not re.search(r":\w+:`", text), text
    assert not CHECKOUT_ONLY.search(text), CHECKOUT_ONLY.search(text)


@pytest.mark.parametrize("port", ["65536", "70000", "-1", "http"])
def test_serve_port_must_be_a_tcp_port(port, capsys):
    """``--port 70000`` listened on 4464 (70000 mod 65536) while the startup line said 70000."""
    build = parsers().get("serve")
    if build is None:
        pytest.skip("the serve extra is not installed")
    assert build().parse_args(["m", "--port", "65535"]).port == 65535
    assert build().parse_args(["m", "--port", "0"]).port == 0  # any free port
    with pytest.raises(SystemExit):
        build().parse_args(["m", "--port", port])
    assert "argument --port: expected a TCP port, 0 to 65535" in capsys.readouterr().err


def test_serve_refuses_an_empty_served_model_name(capsys):
    """``--served-model-name ''`` served under the checkpoint's path instead."""
    try:
        from jax_tokenweave import serve
    except ImportError:
        pytest.skip("the serve extra is not installed")
    with pytest.raises(SystemExit):
        serve.main(["--random", "tiny", "--served-model-name", " "])
    assert "--served-model-name: an empty name" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["1,,5", ",", "", "1,"])
def test_generate_ids_with_an_empty_item_are_refused(text):
    """``--ids 1,,5`` dropped the empty item and ran ``[1, 5]``."""
    import argparse

    from jax_tokenweave import generate

    with pytest.raises(argparse.ArgumentTypeError, match="an empty item"):
        generate.token_ids(text)
    assert generate.token_ids("1, 2 ,3") == [1, 2, 3]
