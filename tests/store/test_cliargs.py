"""``tracestore.cliargs``, the command-line pieces tracestore's and tracerl's commands share: ``--debug`` before and
after every subcommand, storage options, number types, negative numbers as option values, and a light import."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

import tracestore as ts
from tracestore import cliargs
from tracestore.cli import build_parser, main

#: every subcommand with the positional arguments it needs
COMMANDS = {"create": ["u"], "info": ["u"], "ls": ["u"], "show": ["u", "t"], "tail": ["u"], "verify": ["u"],
            "gc": ["u"], "compact": ["u"], "export": ["u", "out.parquet"], "bench": []}


def test_commands_are_all_listed():
    assert set(build_parser().subcommands) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_debug_before_and_after_every_subcommand(command):
    parser = build_parser()
    positional = COMMANDS[command]
    assert parser.parse_args([command, *positional]).debug is False
    assert parser.parse_args(["--debug", command, *positional]).debug is True
    assert parser.parse_args([command, *positional, "--debug"]).debug is True
    assert parser.parse_args(["--debug", command, "--debug", *positional]).debug is True


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_in_either_place(tmp_path, where, capsys):
    url = str(tmp_path / "none")
    assert main(["info", url]) == cliargs.EXIT_ERROR
    assert "StoreNotFoundError" in capsys.readouterr().err
    argv = ["--debug", "info", url] if where == "before" else ["info", url, "--debug"]
    with pytest.raises(ts.StoreNotFoundError):
        main(argv)


def test_usage_error_is_one_class_everywhere():
    from tracestore.cli.main import UsageError, storage_options

    assert UsageError is cliargs.UsageError and storage_options is cliargs.storage_options
    assert issubclass(cliargs.UsageError, ts.TraceStoreError) and issubclass(cliargs.UsageError, ValueError)
    assert (cliargs.EXIT_PROBLEMS, cliargs.EXIT_ERROR, cliargs.EXIT_INTERRUPTED) == (1, 2, 130)


def _storage_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cliargs.add_storage_arguments(p)
    return p.parse_args(list(argv))


def test_storage_options_rules(tmp_path, monkeypatch):
    monkeypatch.delenv(cliargs.ENV_STORAGE_OPTIONS, raising=False)
    assert cliargs.storage_options(_storage_args(), "/local/path") is None
    got = cliargs.storage_options(_storage_args("--storage-options", '{"key": "k"}', "--endpoint-url", "http://h:9"),
                                  "s3://b/p")
    assert got == {"key": "k", "client_kwargs": {"endpoint_url": "http://h:9"}}
    f = tmp_path / "o.json"
    f.write_text(json.dumps({"secret": "s"}))
    assert cliargs.storage_options(_storage_args("--storage-options", f"@{f}"), "s3://b/p") == {"secret": "s"}
    monkeypatch.setenv(cliargs.ENV_STORAGE_OPTIONS, '{"anon": true}')
    assert cliargs.storage_options(_storage_args(), "s3://b/p") == {"anon": True}
    assert cliargs.storage_options(_storage_args(), "/local/path") is None  # the variable is for remote URLs
    assert cliargs.storage_options(_storage_args(), "file:///local") is None
    for argv, url, match in ((("--storage-options", "{bad"), "s3://b/p", "not valid JSON"),
                             (("--storage-options", "[1]"), "s3://b/p", "JSON object"),
                             (("--storage-options", f"@{tmp_path / 'missing.json'}"), "s3://b/p", "cannot read"),
                             ((), "memory://x", "memory://")):
        with pytest.raises(cliargs.UsageError, match=match):
            cliargs.storage_options(_storage_args(*argv), url)


@pytest.mark.parametrize("kind,text,ok,message", [
    (cliargs.int_at_least(1), "0", None, "must be >= 1, got 0"),
    (cliargs.int_at_least(1), "x", None, "expected an integer, got 'x'"),
    (cliargs.int_at_least(0), "0", 0, None),
    (cliargs.positive_int, "3", 3, None),
    (cliargs.nonneg_int, "-1", None, "must be >= 0, got -1"),
    (cliargs.float_above(0.0), "0", None, "must be a finite number > 0, got 0"),
    (cliargs.float_above(0.0), "nan", None, "must be a finite number > 0, got nan"),
    (cliargs.float_above(0.0), "inf", None, "must be a finite number > 0, got inf"),
    (cliargs.float_above(0.0), "a", None, "expected a number, got 'a'"),
    (cliargs.positive_float, "0.5", 0.5, None),
    (cliargs.nonneg_float, "0", 0.0, None),
    (cliargs.nonneg_float, "-0.1", None, "must be a finite number >= 0, got -0.1"),
    (cliargs.finite_float, "-1e-05", -1e-05, None),
    (cliargs.finite_float, "-inf", None, "expected a finite number, got '-inf'"),
])
def test_number_types(kind, text, ok, message):
    if message is None:
        assert kind(text) == ok
        return
    with pytest.raises(argparse.ArgumentTypeError) as e:
        kind(text)
    assert str(e.value) == message


@pytest.mark.parametrize("argv", [["--x", "-1e-05"], ["--x=-1e-05"], ["--x", "-2"], ["--x", "-.5"],
                                  ["sub", "--x", "-1E+3"]])
def test_negative_numbers_are_option_values(argv):
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--x", type=cliargs.finite_float)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("sub").add_argument("--x", type=cliargs.finite_float)
    cliargs.accept_negative_numbers(parser)
    assert parser.parse_args(argv).x == float(argv[-1].split("=")[-1])


def test_negative_number_in_a_tracestore_option_is_its_value_not_a_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["gc", "u", "--grace", "-1e-05"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "must be a finite number > 0, got -1e-05" in err and "expected one argument" not in err


def test_cliargs_and_the_cli_import_nothing_heavy():
    code = ("import sys, tracestore.cliargs, tracestore.cli\n"
            "heavy = sorted(m for m in ('numpy', 'pyarrow', 'zarr', 'torch') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
