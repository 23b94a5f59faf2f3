"""The ``tracerl`` command line as a new user meets it: light imports, help on every option, bad options and bad
store locations answered at once (one line, exit 2), unknown flags with the subcommand's usage."""

import argparse
import json
import os
import subprocess
import sys

import pytest

import tracestore as ts
from tracerl.cli import build_parser, main
from tracerl.cli.demo import SPEC_OPTIONS
from tracerl.config import DemoConfig
from tracerl.config import check_new_store
from tracerl.demo import run_demo
from tracerl.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--trajectories", "2", "--tokens", "24", "--threads", "2", "--hidden", "64", "--layers", "4", "--experts",
        "4", "--vocab", "128"]


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "tracerl.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_cli_import_and_parser_load_no_torch():
    """`tracerl --help` must not wait for torch / transformers (it took 1.9 s): building the parser imports
    neither, nor tracestore's data modules (only `tracestore.cliargs`, the command-line pieces both CLIs share,
    which import nothing heavy); the public names of `tracerl` still resolve (on first use)."""
    code = (
        "import sys, tracerl.cli; tracerl.cli.build_parser(); import tracerl; "
        "heavy = [m for m in ('torch', 'transformers', 'tracestore.store', 'pyarrow', 'zarr', 'numpy') "
        "if m in sys.modules]; "
        "assert not heavy, heavy; "
        "from tracerl import RolloutEngine, MODES, QATTrainer; assert 'fp4_hints' in MODES; print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    import tracerl

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tracerl.nope
    assert "RolloutEngine" in dir(tracerl)


def _subparsers(p: argparse.ArgumentParser):
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_option_has_help():
    p = build_parser()
    commands = dict(_subparsers(p))
    assert "demo" in commands
    for name, parser in [("tracerl", p), *commands.items()]:
        for action in parser._actions:
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings} has no help"


def test_model_size_help_states_the_spec_defaults():
    """The model-size options' help gives TinyMoESpec's defaults (the parser cannot import it: torch)."""
    from tracerl.policy import TinyMoESpec

    demo = dict(_subparsers(build_parser()))["demo"]
    helps = {a.dest: a.help for a in demo._actions}
    spec = TinyMoESpec()
    for opt, field in SPEC_OPTIONS.items():
        assert f"(default {getattr(spec, field)}" in helps[opt], (opt, helps[opt])


@pytest.mark.parametrize("option, value", [
    ("--trajectories", "0"), ("--trajectories", "-3"), ("--trajectories", "two"), ("--tokens", "0"),
    ("--seed", "-1"), ("--hidden", "0"), ("--layers", "0"), ("--experts", "0"), ("--vocab", "0"),
    ("--threads", "-1"),
])
def test_numeric_options_checked_at_parse_time(option, value, capsys):
    """`tracerl demo --trajectories 0` crashed with a traceback (exit 1); every numeric option is checked by
    the parser: exit 2 with the demo's usage and the option named."""
    with pytest.raises(SystemExit) as e:
        main(["demo", option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tracerl demo" in err and f"argument {option}" in err and "Traceback" not in err


def test_trajectories_zero_in_a_subprocess():
    out = _run_cli("demo", "--trajectories", "0")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == "tracerl demo: error: argument --trajectories: must be >= 1, got 0"


@pytest.mark.parametrize("extra, message", [
    (["--tokens", "17"], "no room for a response"),
    (["--hidden", "40"], "multiple of 16"),
    (["--experts", "300"], "num_experts=300"),
    (["--experts", "1"], "top_k (2) <= num_experts"),
    (["--vocab", "1"], "vocab_size=1"),
])
def test_option_combinations_fail_before_anything_is_built(extra, message, tmp_path, capsys):
    url = tmp_path / "never"
    assert main(["demo", *TINY, *extra, "--store", str(url)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not url.exists()


def test_unknown_flag_after_subcommand_shows_subcommand_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--trajectoriez", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tracerl demo" in err and "unrecognized arguments: --trajectoriez" in err


@pytest.mark.parametrize("case", ["existing store", "a file", "a directory with files", "below a file"])
def test_bad_store_is_reported_before_the_model_is_built(case, tmp_path, capsys):
    """A bad --store was reported after the model was built and calibrated (15 s); now before anything runs:
    `run_demo` reports no phase, the CLI exits 2 with one line."""
    if case == "existing store":
        url = str(tmp_path / "store")
        ts.create_store(url, [ts.Site("s", 16)])
    elif case == "a file":
        url = str(tmp_path / "f")
        open(url, "w").close()
    elif case == "a directory with files":
        url = str(tmp_path)
        open(tmp_path / "notes.txt", "w").close()
    else:
        open(tmp_path / "f", "w").close()
        url = str(tmp_path / "f" / "store")
    phases = []
    with pytest.raises(ConfigError, match="store"):
        run_demo(DemoConfig(trajectories=2, tokens=24, store=url), on_step=lambda *a: phases.append(a))
    assert phases == []
    assert main(["demo", *TINY, "--store", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tracerl demo: ConfigError: store ") and len(err.strip().splitlines()) == 1


def test_new_store_locations_pass(tmp_path):
    check_new_store(str(tmp_path / "a" / "b" / "store"))  # parents are created with it
    (tmp_path / "empty").mkdir()
    check_new_store(str(tmp_path / "empty"))
    check_new_store("memory://tracerl-cli-test-new")
    assert not (tmp_path / "a").exists()  # the check creates nothing


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_store_parent(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="not writable"):
        check_new_store(str(ro / "store"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(trajectories=0), "trajectories=0"), (dict(micro_batch_tokens=0), "micro_batch_tokens=0"),
    (dict(flush_tokens=0), "flush_tokens=0"), (dict(seed=-1), "seed=-1"), (dict(tokens=17), "tokens >= 18"),
    (dict(prompt_tokens=(0, 4)), "prompt_tokens"), (dict(prompt_tokens=(9, 4)), "prompt_tokens"),
    (dict(model="llama"), "model='llama'"), (dict(decode="fast"), "decode='fast'"),
    (dict(hint_sites="some"), "hint_sites='some'"), (dict(fp4="all"), "fp4='all'"),
])
def test_demo_config_check(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        DemoConfig(**kwargs).check()
    DemoConfig().check()


def test_demo_progress_counts_steps(capsys):
    """The demo reports each long phase as steps done / total (the CLI shows them as rich progress bars with
    an ETA): decode steps of both rollouts, micro-batches x modes of the recompute."""
    events = []
    cfg = DemoConfig(trajectories=2, tokens=24, spec=dict(hidden_size=64, num_layers=2, num_experts=4, vocab_size=128))
    messages = []
    run_demo(cfg, messages.append, on_step=lambda *a: events.append(a))
    phases = list(dict.fromkeys(p for p, _, _ in events))
    assert messages == phases and len(phases) == 4
    max_new = cfg.tokens - cfg.prompt_tokens[1]
    for phase in phases:
        steps = [(d, t) for p, d, t in events if p == phase]
        total = steps[0][1]
        assert [d for d, _ in steps] == list(range(total + 1)) and all(t == total for _, t in steps)
    assert [t for p, _, t in events if p.startswith("FP4 rollout")][0] == max_new
    assert [t for p, _, t in events if p == "trainer recompute"][0] == 4  # one micro-batch, four modes
    assert main(["demo", "--json", *TINY]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["rollout"]["trajectories"] == 2
    assert "trainer recompute" in out.err and "4/4" in out.err  # the bars, on stderr


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from dict(action.choices).items()


def test_help_of_every_command_has_examples_metavars_and_defaults():
    """What a newcomer tripped over: help without example lines, argparse's default metavars (``--tis-cap
    TIS_CAP``), options whose default the help does not state."""
    problems = []
    for name, sub in _subparsers(build_parser()):
        if not (sub.epilog and "examples:" in sub.epilog and f"tracerl {name}" in sub.epilog):
            problems.append(f"{name}: no example lines")
        for a in sub._actions:
            if not a.option_strings or a.nargs == 0 or a.help == argparse.SUPPRESS:
                continue
            if a.metavar is None and a.choices is None:
                problems.append(f"{name} {a.option_strings[-1]}: argparse's default metavar {a.dest.upper()}")
            if a.default not in (None, argparse.SUPPRESS) and "default" not in (a.help or ""):
                problems.append(f"{name} {a.option_strings[-1]}: default {a.default!r} not in its help")
    assert not problems, problems


def test_version():
    out = _run_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("tracerl ") and out.stdout.split()[1][0].isdigit()


@pytest.mark.parametrize("command", ["demo", "train", "rollout", "loop", "replay", "audit"])
def test_debug_goes_before_or_after_the_command(command):
    needs = {"train": ["s", "--checkpoints", "c"], "rollout": ["s"], "replay": ["s", "--from", "c"],
             "audit": ["s"]}.get(command, [])
    parser = build_parser()
    assert parser.parse_args([command, *needs]).debug is False
    assert parser.parse_args(["--debug", command, *needs]).debug is True
    assert parser.parse_args([command, *needs, "--debug"]).debug is True


def test_a_negative_target_excess_is_a_value():
    """``--target-excess -1e-05`` (a target below the floor) was read as a missing argument."""
    args = build_parser().parse_args(["audit", "s", "--target-excess", "-1e-05"])
    assert args.target_excess == -1e-05


@pytest.mark.parametrize("argv, message", [
    (["audit", "{tmp}/not-a-store"], "StoreNotFoundError: no tracestore store at"),
    (["demo", "--store", "{tmp}/full", "--trajectories", "2"], "ConfigError: store "),
    (["demo", "--hidden", "40"], "multiple of 16"),
    (["demo", "--hint-layers", "0,99"], "out of range"),
    (["audit", "{tmp}/not-a-store", "--storage-options", "{{bad"], "UsageError: --storage-options: not valid JSON"),
])
def test_bad_arguments_answer_before_torch_is_loaded(argv, message, tmp_path):
    """`tracerl audit not-a-store`, `demo --store <non-empty dir>`, `--hidden 40` imported torch and built a model
    before they said what was wrong; now they exit 2 with one line and torch never loads."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    argv = [a.format(tmp=tmp_path) for a in argv]
    code = ("import sys; from tracerl.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
