"""`tracerl audit` on a tiny demo store: the same agreement figures as `tracerl demo` (same seed), the replay
reproduces the store, the JSON has the documented keys, a corrupt chunk is reported (object named) instead of a
crash, bad arguments give one line and exit 2.

One tiny store and one audit of it (module fixture, ~30 s on two cores) serve most tests."""

import base64
import contextlib
import importlib.util
import io
import re
import time
import json
import os
import shutil

import pytest

import tracestore as ts
from tracerl.audit import DETAIL_KEYS, MODE_NAMES, TOP_KEYS
from tracerl.cli import main
from tracerl.config import DemoConfig
from tracerl.demo import run_demo

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")
SPEC = {"hidden_size": 64, "num_layers": 4, "num_experts": 4, "vocab_size": 128}
CFG = dict(trajectories=4, tokens=40, seed=3, spec=SPEC)

#: the documented JSON keys (README "Audit", tracerl.audit docstring)
MODE_KEYS = {"code_agreement", "scale_agreement", "one_step_share", "multi_step_share", "router_flip_rate",
             "mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp", "k3", "extreme_frac", "tokens", "excess_over_floor"}
SITE_KEYS = {"site", "layer", "kind", "hinted", "width", "code_agreement", "one_step_share", "multi_step_share",
             "scale_agreement", "values", "mismatches"}
SLICE_KEYS = {"tokens", "mean_abs_dlogp", "floor_mean_abs_dlogp", "excess", "router_flip_rate", "code_agreement",
              "one_step_share", "multi_step_share", "scale_agreement"}
STORE_KEYS = {"url", "trajectories", "audited_trajectories", "response_tokens", "hinted_sites", "fp4_sites",
              "hint_bytes_per_token", "site_bytes", "policy_versions", "model"}
INTEGRITY_KEYS = {"ok", "checked", "errors", "entries", "records", "segments", "chunks", "bytes",
                  "skipped_trajectories"}
REPLAY_KEYS = {"decode_path", "recorded_decode_path", "reproduced", "hints_equal", "scales_equal", "routes_equal",
               "logprobs_equal", "max_abs_logprob_diff", "weights"}
TIMING_KEYS = {"seconds", "verify_s", "setup_s", "replay_s", "floor_s", "decode_s", "concurrent_decode", "passes_s",
               "curve_s", "passes", "micro_batches"}


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse: the usage, then one error line
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """(demo result, audit JSON, store URL, tmp dir): `run_demo` keeps a store, `tracerl audit --json` audits it."""
    tmp = tmp_path_factory.mktemp("audit")
    url = str(tmp / "store")
    demo = run_demo(DemoConfig(store=url, **CFG))
    html = ["--html", str(tmp / "report.html")] if importlib.util.find_spec("matplotlib") else []
    rc, out, err = _cli("audit", url, "--json", "--threads", "2", "--bands", "2", *html)
    assert rc == 0, err
    return demo, json.loads(out), url, tmp


def test_same_agreement_figures_as_the_demo(audited):
    """The audit recomputes from the store alone what the demo measured with the rollout in memory: code and scale
    agreement, one-step share, router flips and |dlogp| of every mode, and the floor, are the same numbers."""
    demo, audit, _, _ = audited
    for mode, d in demo["modes"].items():
        a = audit["modes"][mode]
        for key in ("code_agreement", "scale_agreement", "router_flip_rate", "mean_abs_dlogp", "p99_abs_dlogp",
                    "max_abs_dlogp", "k3", "tokens"):
            if d[key] is None:  # (the floor has no codes) pytest >= 9.2 refuses approx(None) with a tolerance
                assert a[key] is None, (mode, key)
            else:
                assert a[key] == pytest.approx(d[key], rel=1e-12, abs=0), (mode, key)
        if d.get("mismatch_one_step_share") is not None:
            assert a["one_step_share"] == pytest.approx(d["mismatch_one_step_share"], rel=1e-12)
    # the hinted modes really differ from round-to-nearest here (the comparison is not between constants)
    assert audit["modes"]["fp4_hints"]["code_agreement"] > audit["modes"]["fp4_rne_own_scales"]["code_agreement"]
    assert audit["modes"]["fp4_rne_own_scales"]["code_agreement"] < 1


def test_replay_reproduces_the_store(audited):
    """The rollout's decode, replayed with the stored tokens forced (the recorded batch, decode path and
    temperature from the store's metadata), gives back every stored hint bit, scale, route and log-prob."""
    _, audit, url, _ = audited
    rep = audit["replay"]
    assert rep["reproduced"] is True and rep["decode_path"] == rep["recorded_decode_path"] == "static"
    assert rep["hints_equal"] == rep["scales_equal"] == rep["routes_equal"] == rep["logprobs_equal"] == 1.0
    meta = ts.open_store(url).model
    assert meta["rollout"]["batches"] == [[f"traj-{i:04d}" for i in range(CFG["trajectories"])]]


def test_json_has_the_documented_keys(audited):
    _, audit, _, _ = audited
    assert list(audit) == list(TOP_KEYS)
    assert set(audit["modes"]) == set(MODE_NAMES) and audit["audited_mode"] == "fp4_hints"
    for m in audit["modes"].values():
        assert set(m) == MODE_KEYS
    assert set(audit["store"]) == STORE_KEYS and set(audit["integrity"]) == INTEGRITY_KEYS
    assert set(audit["replay"]) == REPLAY_KEYS and set(audit["timing"]) == TIMING_KEYS
    assert set(audit["detail"]) == set(MODE_NAMES) - {"floor"}
    for mode, d in audit["detail"].items():
        assert list(d) == list(DETAIL_KEYS)
        for r in d["per_trajectory"] + d["by_position"] + d["per_policy_version"]:
            assert set(r) - {"traj_id", "policy_version", "lo", "hi"} == (
                SLICE_KEYS if mode != "bf16" else SLICE_KEYS - {"code_agreement", "one_step_share",
                                                                 "multi_step_share", "scale_agreement"})
    sites = audit["detail"]["fp4_hints"]["per_site"]
    assert {s["site"] for s in sites} == set(audit["store"]["fp4_sites"])  # every FP4 site, hinted or not
    assert all(set(s) == SITE_KEYS for s in sites)
    assert {s["site"] for s in sites if s["hinted"]} == set(audit["store"]["hinted_sites"])
    # per-site counts add up to the mode's figure at the hinted sites
    hinted = [s for s in sites if s["hinted"]]
    agree = sum(s["values"] - s["mismatches"] for s in hinted) / sum(s["values"] for s in hinted)
    assert agree == pytest.approx(audit["modes"]["fp4_hints"]["code_agreement"], rel=1e-12)
    assert sum(r["tokens"] for r in audit["detail"]["fp4_hints"]["per_trajectory"]) == audit["store"]["response_tokens"]
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("## Audit"):]
    for key in [*TOP_KEYS, *MODE_KEYS, *DETAIL_KEYS, *REPLAY_KEYS]:
        assert f"`{key}`" in section or key in section, f"README's Audit section does not document {key}"


def test_corrupt_chunk_is_reported_with_the_object(audited, tmp_path):
    """A flipped byte in a hints shard: verify names the object, the audit names the trajectories it had to leave
    out, prints one line and exits 1 (no traceback)."""
    _, _, url, _ = audited
    bad = tmp_path / "bad"
    shutil.copytree(url, bad)
    shard = next(p for p in sorted(bad.rglob("*")) if p.is_file() and p.parent.name.startswith("hints."))
    data = bytearray(shard.read_bytes())
    data[0] ^= 0x01
    shard.write_bytes(bytes(data))
    rc, out, err = _cli("audit", str(bad), "--json", "--threads", "2", "--no-attribution", "--no-planner")
    assert rc == 1
    res = json.loads(out)
    integ = res["integrity"]
    assert integ["ok"] is False and integ["checked"] is True
    key = shard.relative_to(bad).as_posix()
    assert any(key in e and "crc32c" in e for e in integ["errors"]), integ["errors"]
    assert {s["traj_id"] for s in integ["skipped_trajectories"]} == {f"traj-{i:04d}" for i in range(4)}
    assert all("IntegrityError" in s["reason"] for s in integ["skipped_trajectories"])
    assert res["modes"] == {} and res["store"]["audited_trajectories"] == 0
    assert "integrity problems" in err and "Traceback" not in err
    html = ["--html", str(tmp_path / "bad.html")] if importlib.util.find_spec("matplotlib") else []
    rc, out, err = _cli("audit", str(bad), "--threads", "2", "--no-attribution", "--no-planner", *html)
    assert rc == 1 and "FAILED" in out and key in out
    if html:
        page = (tmp_path / "bad.html").read_text(encoding="utf-8")
        assert "tracestore verify: FAILED" in page and key in page and "Nothing was measured" in page


@pytest.mark.parametrize("argv, message", [
    (["--bands", "0"], "--bands"),
    (["--target-excess", "nan"], "finite"),
    (["--plan-out", "x.json"], "--plan-out needs --target-excess"),
    (["--target-excess", "0.1", "--no-planner"], "needs the planner"),
    (["--device", "gpu0"], "device"),
    (["--device", "cuda:0"], "CUDA"),
    (["--model", "/nonexistent.safetensors"], "--model"),
    (["--storage-options", "{not json"], "--storage-options"),
    (["--html", "/nonexistent/dir/report.html"], "does not exist"),
    (["--margins", "0.1"], "expected M:MS"),
    (["--margins", "a:0.1"], "numbers >= 0"),
    (["--margins", "nan:0"], "numbers >= 0"),
    (["--margins=-1:0"], "numbers >= 0"),
    (["--margins", "0.1:0.1:bits"], "payload one of byte, lsb"),
    (["--margins", "0.1:0.1,0.1:0.1"], "each once"),
    (["--margin-sites", "all"], "--margin-sites needs --margins"),
    (["--margin-planner"], "--margin-planner needs --margins"),
    (["--margins", "0:0", "--margin-planner"], "--margin-planner needs the planner"),
])
def test_bad_arguments_one_line_exit_2(audited, argv, message):
    _, _, url, _ = audited
    rc, _, err = _cli("audit", url, "--no-attribution", "--no-planner", *argv)
    assert rc == 2 and "Traceback" not in err
    assert message in err.strip().splitlines()[-1], err


def test_store_problems_one_line_exit_2(tmp_path):
    rc, _, err = _cli("audit", str(tmp_path / "nope"))
    assert rc == 2 and "StoreNotFoundError" in err and err.count("\n") == 1
    plain = str(tmp_path / "plain")
    ts.create_store(plain, [ts.Site("a", 64)])  # a store without tracerl's model metadata
    rc, _, err = _cli("audit", plain)
    assert rc == 2 and "model metadata lacks" in err and err.count("\n") == 1


def test_attribution_parts_add_up(audited):
    """The attribution of the audited gap: floor + parts + (residual - floor) is the total; the parts add up
    within the stated tolerance (|residual - floor| <= ADDITIVITY_TOLERANCE * total, mean |dlogp|); routing's part
    is what routing replay removes; the pass with every FP4 site exact carries the rollout's codes everywhere."""
    from tracerl.audit.plan import ADDITIVITY_TOLERANCE

    _, audit, _, _ = audited
    a, modes = audit["attribution"], audit["modes"]
    assert a["tolerance"] == ADDITIVITY_TOLERANCE and a["exact_code_agreement"] == 1.0
    assert a["order"][0] == "routing" and len(a["order"]) == 1 + len(a["groups"])
    for which in ("mean_abs", "mean_sq"):
        m = a[which]
        assert m["floor"] + sum(m["parts"].values()) + m["interaction"] == pytest.approx(m["total"], rel=1e-12)
        assert m["interaction"] == pytest.approx(m["residual"] - m["floor"], rel=1e-9, abs=1e-15)
    ab = a["mean_abs"]
    assert ab["total"] == pytest.approx(modes["fp4_hints"]["mean_abs_dlogp"], rel=1e-12)
    assert ab["floor"] == pytest.approx(modes["floor"]["mean_abs_dlogp"], rel=1e-12)
    assert ab["parts"]["routing"] == pytest.approx(
        modes["fp4_hints"]["mean_abs_dlogp"] - modes["fp4_hints_replay_routes"]["mean_abs_dlogp"], rel=1e-9, abs=1e-15)
    assert abs(ab["interaction"]) <= ADDITIVITY_TOLERANCE * ab["total"] and a["adds_up"] is True
    assert a["dominant"] in ("floor", *ab["parts"])
    assert max([ab["floor"], *ab["parts"].values()]) == ({"floor": ab["floor"]} | ab["parts"])[a["dominant"]]
    # every non-KV FP4 site is in exactly one group
    grouped = [s for g in a["groups"] for s in g["sites"]]
    assert sorted(grouped) == sorted(audit["store"]["fp4_sites"])


def test_planner_curve_is_measured(audited):
    """The curve starts at round-to-nearest (nothing hinted), tries the units in ranking order and keeps each that
    lowers the measured mean |dlogp|, ends at every FP4 site, and every point is a measured pass; a point that
    hints exactly the store's sites (hints derived from the replay) measures what the store's own hints give."""
    _, audit, _, _ = audited
    p, modes = audit["planner"], audit["modes"]
    curve, units, rejected = p["curve"], p["units"], p["rejected"]
    assert len(p["ranking"]) == len(units) and curve[0]["k"] == 0 and curve[-1]["k"] == len(units)
    assert curve[0]["sites"] == [] and curve[0]["mean_abs_dlogp"] == modes["fp4_rne_own_scales"]["mean_abs_dlogp"]
    assert curve[0]["excess"] == pytest.approx(modes["fp4_rne_own_scales"]["excess_over_floor"], rel=1e-12)
    assert sorted(curve[-1]["sites"]) == sorted(audit["store"]["fp4_sites"])
    assert curve[-1]["bytes_per_token"] == sum(u["bytes_per_token"] for u in units)
    assert all(a["bytes_per_token"] < b["bytes_per_token"] for a, b in zip(curve, curve[1:]))
    kept = curve[:-1] if rejected else curve  # (the full-coverage point follows the kept ones when units were set aside)
    assert all(b["mean_abs_dlogp"] < a["mean_abs_dlogp"] for a, b in zip(kept, kept[1:]))
    assert all(b["units"][:-1] == a["units"] for a, b in zip(kept, kept[1:]))  # each point adds one unit
    order = [r["unit"] for r in p["ranking"]]
    tried = [c["units"][-1] for c in kept[1:]] + [r["unit"] for r in rejected]
    assert sorted(tried, key=order.index) == order  # every unit tried once: kept or set aside
    for r in rejected:  # measured on top of the units kept before it, and no better than them
        before = next(c for c in kept if c["units"] == r["units"][:-1])
        assert r["units"][-1] == r["unit"] and r["mean_abs_dlogp"] >= before["mean_abs_dlogp"]
    assert p["store_coverage"]["excess"] == modes["fp4_hints"]["excess_over_floor"]
    assert p["store_coverage"]["bytes_per_token"] == audit["store"]["hint_bytes_per_token"]
    for c in curve:
        if sorted(c["sites"]) == sorted(audit["store"]["hinted_sites"]):
            assert c["mean_abs_dlogp"] == pytest.approx(modes["fp4_hints"]["mean_abs_dlogp"], rel=1e-12)
    best = p["budget"]["best"]
    assert best["bytes_per_token"] <= p["budget"]["bytes_per_token"] == 7680
    assert p["budget"]["best_by_encoding"]["bytes"] == best
    lsb = p["budget"]["best_by_encoding"]["lsb"]
    assert lsb["bytes_per_token_by_encoding"]["lsb"] <= 7680 and lsb["excess"] <= best["excess"]


def test_target_excess_site_table_round_trips(audited, tmp_path):
    """--target-excess prints the cheapest measured coverage as a site table: `tracestore create --site-table`
    takes it, and the rollout side's site plan from it hints exactly those sites."""
    from tracestore.cli.main import main as tracestore_main
    from tracerl.audit.plan import hint_sites_from_table
    from tracerl.policy import TinyMoESpec, build_model
    from tracerl.policy import plan_sites

    _, audit, url, _ = audited
    curve = audit["planner"]["curve"]
    target = min(c["excess"] for c in curve[1:])
    assert target < curve[0]["excess"]  # hints help on this store, so the plan hints something
    want = min((c for c in curve if c["excess"] <= target), key=lambda c: c["bytes_per_token"])
    rc, out, err = _cli("audit", url, "--target-excess", repr(target), "--no-attribution", "--threads", "2",
                        "--bands", "2")
    assert rc == 0, err
    table = json.loads(out)  # stdout holds the table alone; the report went to stderr
    assert "coverage planner" in err
    assert [s["name"] for s in table["sites"]] == [s for s in audit["store"]["fp4_sites"] if s in want["sites"]]
    path = tmp_path / "sites.json"
    path.write_text(out)
    new = str(tmp_path / "planned")
    assert tracestore_main(["create", new, "--site-table", str(path)]) == 0
    store = ts.open_store(new)
    assert list(store.sites) == hint_sites_from_table(table)
    assert store.model["site_plan"]["hinted"] == hint_sites_from_table(table)
    assert store.top_k == table["top_k"] and list(store.moe_layers) == table["moe_layers"]
    model = build_model(TinyMoESpec(**store.model["spec"]), seed=store.model["seed"])
    plan = plan_sites(model, fp4=store.model["fp4"], hint_sites=hint_sites_from_table(table))
    assert list(plan.hinted) == [s["name"] for s in table["sites"]]
    assert {s.name: s.width for s in plan.hinted_specs()} == {s["name"]: s["width"] for s in table["sites"]}


def test_hints_from_the_replay_equal_the_stored_ones(tmp_path):
    """On a store that hints every MoE input, the planner's pass hinting that unit (hints and scales derived from
    the replayed codes) gives exactly the audited fp4_hints figures; an unreachable target exits 1."""
    url = str(tmp_path / "all")
    run_demo(DemoConfig(store=url, trajectories=2, tokens=24, seed=5, hint_layers="all", spec=SPEC))
    rc, out, err = _cli("audit", url, "--json", "--no-attribution", "--bands", "1", "--threads", "2",
                        "--target-excess", "-1")
    assert rc == 1 and "no measured coverage reaches" in err
    res = json.loads(out)
    assert res["planner"]["target"]["meets"] is False and res["planner"]["target"]["site_table"] is None
    rne = res["modes"]["fp4_rne_own_scales"]["mean_abs_dlogp"]
    gain = {r["unit"]: r["gain"] for r in res["planner"]["ranking"]}
    assert rne - gain["moe-in L0-3"] == pytest.approx(res["modes"]["fp4_hints"]["mean_abs_dlogp"], rel=1e-9)


def test_html_report_is_self_contained_and_its_images_decode(audited):
    """--html: one file, every image embedded as a PNG data URI that decodes; the integrity result and the plots'
    subjects are on the page."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    _, audit, _, tmp = audited
    page = (tmp / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "tracestore verify: OK" in page
    srcs = re.findall(r"<img [^>]*src='([^']*)'", page)
    assert len(srcs) == 4  # agreement by layer, |dlogp| histogram, mismatch by position, excess vs bytes
    for alt in ("agreement by layer", "|dlogp| histogram", "mismatch by token position", "excess vs bytes per token"):
        assert f"alt='{alt}'" in page
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        img = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1], validate=True)))
        img.load()  # decodes every pixel
        assert img.format == "PNG" and img.size[0] > 300 and img.size[1] > 200
    assert not re.search(r"(src|href)=['\"](?!data:)", page)  # nothing outside the file
    for site in audit["store"]["fp4_sites"]:
        assert site in page
    rr = audit["planner"]["store_coverage"]["with_routing_replay"]["excess_vs_rne"]
    assert f"with routing replay {rr:.2f}x of round-to-nearest's with routing replay" in page


def test_policy_versions_replay_with_their_published_weights(tmp_path):
    """Trajectories generated by two policy versions: the audit loads each version's published weights before
    replaying its trajectories (the replay reproduces both bit for bit, which the initial weights could not do for
    version 1) and reports per policy version."""
    import torch

    from tracerl import demo as D
    from tracerl.artifacts import weights as tw
    from tracerl.rollout import RolloutRecorder
    from tracerl.util import swapped

    url = str(tmp_path / "versions")
    cfg = DemoConfig(store=url, trajectories=4, tokens=24, seed=7, spec=SPEC)
    s = D._setup(cfg, D._check(cfg))
    rids = [f"traj-{i:04d}" for i in range(4)]
    store = D._create_store(url, cfg, s, rids)
    max_new = cfg.tokens - cfg.prompt_tokens[1]
    with store.writer() as w:
        rec = RolloutRecorder(w, s.site_widths, moe_layers=s.moe_layers, top_k=s.spec.top_k)
        with swapped(s.engine, recorder=rec):
            s.engine.generate(s.prompts[:2], max_new, seed=1, request_ids=rids[:2], policy_version=0)
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():  # a policy update
                for p in s.engine.model.parameters():
                    p.add_((0.02 * torch.randn(p.shape, generator=g)).to(p.dtype))
            tw.publish(url, 1, s.engine.model.state_dict())
            s.engine.generate(s.prompts[2:], max_new, seed=2, request_ids=rids[2:], policy_version=1)
    rc, out, err = _cli("audit", url, "--json", "--no-attribution", "--no-planner", "--threads", "2")
    assert rc == 0, err
    res = json.loads(out)
    assert res["replay"]["weights"] == {"0": "initial", "1": "published"}
    assert res["replay"]["reproduced"] is True and res["store"]["policy_versions"] == [0, 1]
    rows = {r["policy_version"]: r for r in res["detail"]["fp4_hints"]["per_policy_version"]}
    assert set(rows) == {0, 1} and rows[0]["tokens"] == rows[1]["tokens"] == 2 * max_new
    assert {r["traj_id"]: r["policy_version"] for r in res["detail"]["fp4_hints"]["per_trajectory"]} == {
        rids[0]: 0, rids[1]: 0, rids[2]: 1, rids[3]: 1}


def test_side_by_side_decodes_give_the_same_audit(audited):
    """--concurrent-decode on (the floor decode in a second thread while the replay runs; the GPU default) gives
    the same replay result and the same figures of every mode as the sequential decodes (the CPU default)."""
    _, audit, url, _ = audited
    rc, out, err = _cli("audit", url, "--json", "--threads", "2", "--no-attribution", "--no-planner",
                        "--concurrent-decode", "on")
    assert rc == 0, err
    side = json.loads(out)
    assert side["timing"]["concurrent_decode"] is True and audit["timing"]["concurrent_decode"] is False
    assert side["replay"] == audit["replay"]
    assert side["modes"] == audit["modes"]
    assert side["detail"]["bf16"] == audit["detail"]["bf16"]  # the floor's per-token figures too


def test_line_up_runs_set_ups_one_at_a_time_and_never_hangs():
    """The side-by-side decodes' line-up: set-ups (graph capture, prefill) never overlap and the decode loops
    start together; a thread that fails during its set-up breaks the line-up, so the other raises, never waits."""
    import threading

    from tracerl.audit.replay import LineUp

    gate, inside, overlaps, started = LineUp(2), [], [], []

    def ok(name):
        with gate.setup():
            inside.append(name)
            overlaps.append(len(inside))
            time.sleep(0.05)
            inside.remove(name)
            gate.ready()
            started.append(name)

    threads = [threading.Thread(target=ok, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert overlaps == [1, 1] and sorted(started) == ["a", "b"]

    gate, errors = LineUp(2), []

    def fails():
        with contextlib.suppress(RuntimeError), gate.setup():
            raise RuntimeError("set-up failed")

    def waits():
        try:
            with gate.setup():
                gate.ready()
        except threading.BrokenBarrierError as e:
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (waits, fails)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads) and len(errors) == 1


def test_routing_replay_has_its_own_round_to_nearest_reference(audited):
    """fp4_rne_replay_routes (RNE with the rollout's routes) is the like-for-like reference of routing replay: the
    planner reports the store's coverage with routing replay against it, and it is a real pass (its codes agree
    less than the hinted pass's with the same routes)."""
    _, audit, _, _ = audited
    modes = audit["modes"]
    rr, hints_rr = modes["fp4_rne_replay_routes"], modes["fp4_hints_replay_routes"]
    assert rr["code_agreement"] < hints_rr["code_agreement"]
    cov = audit["planner"]["store_coverage"]["with_routing_replay"]
    assert set(cov) == {"excess", "rne_excess", "excess_vs_rne"}
    assert cov["excess"] == hints_rr["excess_over_floor"] and cov["rne_excess"] == rr["excess_over_floor"]
    assert cov["excess_vs_rne"] == pytest.approx(cov["excess"] / cov["rne_excess"], rel=1e-12)


MARGIN_KEYS = {"sites", "site_names", "bits_bytes_per_token", "rne_excess",
               "rne_excess_with_routing_replay", "entropy_floor", "points", "planner", "frontier", "target"}
#: the joint planner's keys (margin.planner; tracerl/audit/run.py's docstring)
JOINT_KEYS = {"options", "moves", "curve", "rejected", "rne_excess", "budget", "site_prices"}
JOINT_POINT_KEYS = {"k", "move", "assignment", "units", "sites", "bytes_per_token", "mean_abs_dlogp", "excess",
                    "excess_vs_rne", "with_routing_replay"}
POINT_KEYS = {"name", "margin", "scale_margin", "scale_payload", "bytes_per_token", "vs_bits", "marked_value_fraction",
              "marked_block_fraction", "marked_mismatch", "unmarked_mismatch", "code_agreement", "scale_agreement",
              "mean_abs_dlogp", "excess", "excess_vs_rne", "with_routing_replay", "site_bytes"}


@pytest.fixture(scope="module")
def margin_audit(audited):
    """The margin points m=0, 0.05 (scale hints) and inf at the hinted sites, and the joint planner over every
    planner unit (whose sites are mostly not hinted: priced from the replay's marks alone)."""
    _, _, url, tmp = audited
    html = ["--html", str(tmp / "margin.html")] if importlib.util.find_spec("matplotlib") else []
    rc, out, err = _cli("audit", url, "--json", "--threads", "2", "--bands", "2", "--no-attribution",
                        "--margins", "0:0,0.05:0.05:lsb,inf:inf", "--margin-planner", "--target-excess", "1", *html)
    # (m=0.1 marked every mismatching value of this tiny store on an AMD EPYC VM on 2026-12-08 — CPU GEMMs round
    # differently across CPUs, README "The demo" — leaving no unmarked mismatch for the comparison below: 0.05 leaves
    # 16 of 236 there)
    assert rc == 0, err
    return json.loads(out), tmp


def test_margin_points_span_round_to_nearest_to_the_stored_hints(audited, margin_audit):
    """Margin 0 stores nothing and is round-to-nearest with own scales, to the last bit; margin inf stores every
    hint and scale and is the store's fp4_hints, to the last bit, at the bytes of today's layout; a point between
    costs bytes between. The margin marks come from the recorded decode path (static here), which the replay still
    reproduces, and the audit's other figures do not change."""
    _, plain, _, _ = audited
    res, _ = margin_audit
    assert res["replay"]["reproduced"] and res["replay"]["decode_path"] == res["replay"]["recorded_decode_path"]
    for mode in MODE_NAMES:
        assert res["modes"][mode] == plain["modes"][mode]
    mg = res["margin"]
    assert set(mg) == MARGIN_KEYS and mg["site_names"] == res["store"]["hinted_sites"]
    zero, mid, full = mg["points"]
    assert all(set(p) == POINT_KEYS for p in mg["points"])
    assert [p["name"] for p in mg["points"]] == ["m=0 ms=0", "m=0.05 ms=0.05 lsb", "m=inf ms=inf"]
    modes = res["modes"]
    for point, own, routed in ((zero, "fp4_rne_own_scales", "fp4_rne_replay_routes"),
                               (full, "fp4_hints", "fp4_hints_replay_routes")):
        assert point["mean_abs_dlogp"] == modes[own]["mean_abs_dlogp"]
        assert point["code_agreement"] == modes[own]["code_agreement"]
        assert point["with_routing_replay"]["mean_abs_dlogp"] == modes[routed]["mean_abs_dlogp"]
    n_sites = len(mg["site_names"])
    # every value and block: today's bytes, plus each row's end in the store (FORMAT §2.5)
    assert full["bytes_per_token"] == mg["bits_bytes_per_token"] + 4 * n_sites
    assert mg["bits_bytes_per_token"] == res["store"]["hint_bytes_per_token"]
    assert zero["bytes_per_token"] == 5 * n_sites  # two empty position sets: one byte per token and site, + its end
    assert zero["bytes_per_token"] < mid["bytes_per_token"] < full["bytes_per_token"]
    assert (zero["marked_value_fraction"], full["marked_value_fraction"]) == (0.0, 1.0)
    assert 0 < mid["marked_value_fraction"] < 1 and 0 < mid["marked_block_fraction"] < 1
    assert full["unmarked_mismatch"] == 0 and zero["marked_mismatch"] == 0
    assert zero["unmarked_mismatch"] > mid["unmarked_mismatch"] > 0  # fewer values left to the trainer's rounding
    assert modes["fp4_rne_own_scales"]["code_agreement"] < mid["code_agreement"] < full["code_agreement"]
    for p in mg["points"]:
        sb = p["site_bytes"]
        assert set(sb) == set(mg["site_names"])
        assert sum(v["bytes_per_token"] for v in sb.values()) == pytest.approx(p["bytes_per_token"], rel=1e-12)
        values = sum(v["values"] for v in sb.values())  # the same mismatches as the pass's code agreement
        assert sum(v["marked_mismatch"] + v["unmarked_mismatch"] for v in sb.values()) == round(
            (1 - p["code_agreement"]) * values)
        assert all(v["tokens"] == v["priced_tokens"] == res["store"]["response_tokens"] for v in sb.values())
    front = mg["frontier"]
    assert [p["bytes_per_token"] for p in front] == sorted(p["bytes_per_token"] for p in front)
    assert all(a["excess"] > b["excess"] for a, b in zip(front, front[1:]))
    assert {p["encoding"] for p in front} <= {"bits", "margin", "mixed"}
    t = mg["target"]
    assert t["meets"] and t["point"]["bytes_per_token"] == 0  # excess <= 1: round-to-nearest already reaches it
    assert t["site_table"] is None  # nothing to declare
    floor = mg["entropy_floor"]
    assert set(floor["sites"]) == set(mg["site_names"]) and 0 < floor["bytes_per_token"] < full["bytes_per_token"]
    assert all(v["tokens"] == res["store"]["response_tokens"] for v in floor["sites"].values())


def test_margin_planner_options_curve_and_anchors(audited, margin_audit):
    """The joint planner over sites x encoding x margin. Anchors: a unit's option at m = ms = inf costs exactly its
    bits bytes and its alone pass is the unit's bits pass to the last bit; at m = 0 it is round-to-nearest to the
    last bit and no move; the curve starts at round-to-nearest (fp4_rne_own_scales) and each kept move lowers the
    measured mean |dlogp|; every point's bytes are the sum of its units' option prices, and an option's price the
    sum of its sites' prices, every unit site priced at every point whether the margin passes encode it or not."""
    _, plain, _, _ = audited
    res, _ = margin_audit
    mg, modes, planner = res["margin"], res["modes"], res["planner"]
    jp = mg["planner"]
    assert set(jp) == JOINT_KEYS
    units = {u["name"]: u for u in planner["units"]}
    assert list(jp["options"]) == list(units)
    rne = modes["fp4_rne_own_scales"]["mean_abs_dlogp"]
    hint_mean = {r["unit"]: rne - r["gain"] for r in planner["ranking"]}  # the planner's hint:<unit> passes
    names = [p["name"] for p in mg["points"]]
    assert set(jp["site_prices"]) == set(names)
    all_sites = {x for u in units.values() for x in u["sites"]}
    assert not all_sites <= set(mg["site_names"])  # units beyond the margin sites: priced from the marks alone
    for name in names:
        prices = jp["site_prices"][name]
        assert set(prices) == all_sites
        for x in mg["site_names"]:  # the margin pass's own price, the same number
            assert prices[x]["bytes_per_token"] == next(p for p in mg["points"]
                                                        if p["name"] == name)["site_bytes"][x]["bytes_per_token"]
        assert all(v["tokens"] == v["priced_tokens"] == res["store"]["response_tokens"] for v in prices.values())
    for unit, opts in jp["options"].items():
        by = {o["option"]: o for o in opts}
        assert list(by) == ["bits", *(f"margin:{n}" for n in names)]
        bits, zero, full = by["bits"], by["margin:m=0 ms=0"], by["margin:m=inf ms=inf"]
        assert bits["bytes_per_token"] == units[unit]["bytes_per_token"]
        assert bits["mean_abs_dlogp"] == pytest.approx(hint_mean[unit], rel=1e-12)
        # every value and block: today's bytes, plus the rows' ends in the store
        assert full["bytes_per_token"] == bits["bytes_per_token"] + 4 * len(units[unit]["sites"])
        assert full["mean_abs_dlogp"] == bits["mean_abs_dlogp"]  # the unit's hint:<unit> pass, to the last bit
        assert zero["mean_abs_dlogp"] == rne and zero["gain"] == 0  # nothing marked: round-to-nearest
        assert zero["bytes_per_token"] == 5 * len(units[unit]["sites"])  # two empty position sets + a row end
        for o in opts:
            name = o["option"].removeprefix("margin:")
            if name != o["option"]:
                assert o["bytes_per_token"] == pytest.approx(
                    sum(jp["site_prices"][name][x]["bytes_per_token"] for x in units[unit]["sites"]), rel=1e-12)
            assert o["gain"] == rne - o["mean_abs_dlogp"]
    moves = jp["moves"]
    assert moves and all(m["option"] != "margin:m=0 ms=0" and m["delta_gain"] > 0 for m in moves)
    for unit in units:  # each unit's moves climb its hull: more bytes, more gain, less gain per byte
        own = [m for m in moves if m["unit"] == unit]
        assert [m["from"] for m in own] == [None, *(m["option"] for m in own[:-1])]
        assert all(b["bytes_per_token"] > a["bytes_per_token"] and b["gain"] > a["gain"]
                   and b["gain_per_kb"] <= a["gain_per_kb"] * (1 + 1e-12) for a, b in zip(own, own[1:]))
    curve, rejected = jp["curve"], jp["rejected"]
    assert all(set(c) == JOINT_POINT_KEYS for c in curve + rejected)
    assert curve[0]["assignment"] == {} and curve[0]["mean_abs_dlogp"] == rne
    assert curve[0]["excess"] == modes["fp4_rne_own_scales"]["excess_over_floor"]
    assert len(curve) + len(rejected) == len(moves) + 1  # every move tried once
    assert all(b["mean_abs_dlogp"] < a["mean_abs_dlogp"] for a, b in zip(curve, curve[1:]))
    assert [c["k"] for c in curve] == list(range(len(curve)))
    for c in curve + rejected:
        opt = {u: {o["option"]: o for o in jp["options"][u]} for u in c["assignment"]}
        assert c["bytes_per_token"] == pytest.approx(
            sum(opt[u][o]["bytes_per_token"] for u, o in c["assignment"].items()), rel=1e-12, abs=0)
        assert [e["site"] for e in c["sites"]] == [x for u in c["assignment"] for x in units[u]["sites"]]
        assert all(e["encoding"] == c["assignment"][u] for u in c["assignment"] for e in c["sites"]
                   if e["site"] in units[u]["sites"])
        if len(c["assignment"]) == 1:  # one unit: its alone pass
            (u, o), = c["assignment"].items()
            assert c["mean_abs_dlogp"] == opt[u][o]["mean_abs_dlogp"]
    for r in rejected:  # measured on top of the moves kept before it, and no better
        before = curve[r["k"] - 1]
        assert r["assignment"] == {**before["assignment"], r["move"]["unit"]: r["move"]["option"]}
        assert r["mean_abs_dlogp"] >= before["mean_abs_dlogp"]
    best = jp["budget"]["best"]
    assert jp["budget"]["bytes_per_token"] == 7680 and best is not None
    assert best["excess"] == min(c["excess"] for c in curve if c["bytes_per_token"] <= 7680)
    rr = best["with_routing_replay"]
    assert rr["rne_excess"] == modes["fp4_rne_replay_routes"]["excess_over_floor"]
    assert rr["excess_vs_rne"] == pytest.approx(rr["excess"] / rr["rne_excess"], rel=1e-12)
    assert sum(c["with_routing_replay"] is not None for c in curve + rejected) == 1
    mixed = [p for p in mg["frontier"] if p["encoding"] == "mixed"]
    assert all(any(c["bytes_per_token"] == p["bytes_per_token"] and c["excess"] == p["excess"] for c in curve)
               for p in mixed)
    # marks at every unit's site leave the replay and every mode as they were
    assert res["replay"]["reproduced"] and res["modes"] == plain["modes"]


def test_margin_planner_site_table_creates_a_store(margin_audit, tmp_path):
    """A joint point with margin-encoded units as a site table: margin sites declared with the keys of their point
    and the coding they were priced in; `tracestore create --site-table` makes the store, the rollout side's site
    plan hints exactly those sites."""
    from tracestore.cli.main import main as tracestore_main
    from tracerl.audit.plan import hint_sites_from_table, joint_site_table
    from tracerl.policy import SitePlan

    res, tmp = margin_audit
    mg, jp = res["margin"], res["margin"]["planner"]
    store = ts.open_store(res["store"]["url"])
    measured = jp["curve"] + jp["rejected"]
    # a measured point with margin-encoded units, mixed with bits ones when there is one
    with_margin = [c for c in measured if any(e["encoding"] != "bits" for e in c["sites"])]
    point = next((c for c in with_margin if any(e["encoding"] == "bits" for e in c["sites"])),
                 with_margin[0] if with_margin else None)
    if point is None:  # no margin option on any unit's hull here: the last point plus one unit at a margin point
        units = {u["name"]: u for u in res["planner"]["units"]}
        last = jp["curve"][-1]
        free = next(u for u in units if u not in last["assignment"])
        point = {"sites": last["sites"] + [{"site": x, "encoding": f"margin:{mg['points'][1]['name']}"}
                                           for x in units[free]["sites"]]}
    points = {p["name"]: (p["margin"], p["scale_margin"], p["scale_payload"]) for p in mg["points"]}
    table = joint_site_table(point["sites"], jp["site_prices"], points, SitePlan.from_json(store.model["site_plan"]),
                             store.model, moe_layers=store.moe_layers, top_k=store.top_k,
                             num_experts=store.num_experts)
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(table))
    new = str(tmp_path / "mixed")
    assert tracestore_main(["create", new, "--site-table", str(path)]) == 0
    made = ts.open_store(new)
    want = {e["site"]: e["encoding"] for e in point["sites"]}
    assert sorted(made.sites) == sorted(want) and sorted(hint_sites_from_table(table)) == sorted(want)
    for name, enc in want.items():
        site = made.sites[name]
        if enc == "bits":
            assert site.hint_encoding == "bits"
            continue
        m, ms, payload = points[enc.removeprefix("margin:")]
        coding = jp["site_prices"][enc.removeprefix("margin:")][name]["coding"]
        assert site.hint_encoding == "margin" and site.scale_payload == payload
        assert (site.margin, site.scale_margin) == tuple(float(v) for v in (m, ms))
        assert (site.value_coding, site.block_coding) == (coding["values"], coding["blocks"])
    assert made.model["site_plan"]["hinted"] == [s for s in res["store"]["fp4_sites"] if s in want]


def test_margin_report_and_html(margin_audit):
    from rich.console import Console

    import html

    from tracerl.audit import render_terminal
    from tracerl.audit.plan import joint_rows

    res, tmp = margin_audit
    con = Console(width=200, record=True)
    for item in render_terminal(res):
        con.print(item)
    text = con.export_text()
    assert "margin exceptions" in text and "m=0.05 ms=0.05 lsb" in text and "Frontier of every measured" in text
    jp = res["margin"]["planner"]
    assert "joint planner" in text and "with routing replay" in text.split("joint planner", 1)[1]
    moved = [c["move"]["unit"] for c in jp["curve"][1:]]
    assert all(u in text for u in moved) and text.count("set aside:") >= len(jp["rejected"])
    if importlib.util.find_spec("matplotlib"):
        page = (tmp / "margin.html").read_text(encoding="utf-8")
        assert "<h2>Margin exceptions</h2>" in page and "m=inf ms=inf" in page
        assert "<h2>Joint planner: sites x encoding x margin</h2>" in page
        joint = page.split("<h2>Joint planner", 1)[1].split("<h2>", 1)[0]
        assert all(html.escape(r[1]) in joint for r in joint_rows(jp)) and "with routing replay" in joint
    with open(README, encoding="utf-8") as f:
        section = f.read().split("## Audit", 1)[1]
    for key in [*MARGIN_KEYS, *POINT_KEYS, "--margins", "--margin-sites"]:
        assert key in section, f"README's Audit section does not document {key}"


def test_the_floor_per_site_stands_next_to_what_each_encoding_stores(margin_audit):
    """Issue 23's per-site report: each margin site's entropy floor beside the bits encoding's bytes and each margin
    point's, in the terminal report and the HTML; the last row sums the columns (the result's totals)."""
    from rich.console import Console

    from tracerl.audit import render_terminal
    from tracerl.audit.plan import floor_rows, site_bytes_per_token

    res, tmp = margin_audit
    mg = res["margin"]
    header, rows = floor_rows(mg)
    assert header[:5] == ["site", "floor B/token", "code bits/token", "scale bits/token", "bits B/token"]
    assert header[5:] == [f"{p['name']} B/token" for p in mg["points"]]
    assert [r[0] for r in rows] == [*mg["site_names"], "all"]
    floor = mg["entropy_floor"]["sites"]
    for site, row in zip(mg["site_names"], rows):
        f = floor[site]
        assert row[1:4] == [f["bytes_per_token"], f["code_bits_per_token"], f["scale_bits_per_token"]]
        assert row[4] == site_bytes_per_token(mg["points"][0]["site_bytes"][site]["width"])
        assert row[5:] == [p["site_bytes"][site]["bytes_per_token"] for p in mg["points"]]
        assert 0 <= row[1] < row[4]  # the floor is below the bits' bytes at these sites
    total = rows[-1]
    assert total[1] == pytest.approx(mg["entropy_floor"]["bytes_per_token"], rel=1e-12)
    assert total[4] == mg["bits_bytes_per_token"]
    assert total[5:] == pytest.approx([p["bytes_per_token"] for p in mg["points"]], rel=1e-12)
    con = Console(width=240, record=True)
    for item in render_terminal(res):
        con.print(item)
    text = con.export_text()
    assert "entropy floor per site" in text
    table = text.split("entropy floor per site", 1)[1]
    assert all(s in table for s in mg["site_names"]) and f"{total[4]:,.1f}" in table
    if importlib.util.find_spec("matplotlib"):
        page = (tmp / "margin.html").read_text(encoding="utf-8")
        part = page.split("<h2>Entropy floor per site</h2>", 1)[1].split("<h2>", 1)[0]
        assert all(s in part for s in mg["site_names"]) and f"{total[1]:,.1f}" in part


def test_margin_tally_prices_rows_as_the_packer_writes_them():
    """MarginTally's bytes are the bytes `compact.pack_rows` writes for the same marks in the chosen coding, and
    with ``every`` it prices every k-th row across micro-batches while counting all of them."""
    import torch

    import tracefp4
    from tracerl.audit.passes import MarginTally
    from tracerl.hints import compact

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 256, generator=gen) * torch.exp(torch.randn(40, 1, generator=gen))
    q = tracefp4.quantize(x, "nvfp4", global_scale=1.0)
    g = torch.tensor(1.0)
    vm, bm = tracefp4.margin_marks(x, g, q.scales, q.hints, 0.1, 0.1)
    codes = tracefp4.unpack_codes(q.codes)
    for every, rows in ((1, range(40)), (3, range(0, 40, 3))):
        tally = MarginTally((0.1, 0.1, "lsb"), every)
        tally.add("s", vm[:17], bm[:17], codes[:17], q.codes[:17])  # two micro-batches
        tally.add("s", vm[17:], bm[17:], codes[17:], q.codes[17:])
        got = tally.site_bytes({"s": 256})["s"]
        idx = torch.tensor(list(rows))
        enc = compact.exceptions_from_marks(vm[idx], bm[idx], q.hints[idx], q.scales[idx], 0.1, 0.1, "lsb")
        coding, _ = compact.choose_coding(enc)
        packed = compact.pack_rows(enc, coding)
        assert got["coding"] == coding.to_json() and got["priced_tokens"] == len(idx) and got["tokens"] == 40
        assert got["row_bytes_per_token"] * len(idx) == packed.nbytes
        assert got["bytes_per_token"] == got["row_bytes_per_token"] + compact.ROW_END_BYTES  # + the row's end
        assert got["values"] == 40 * 256 and got["marked_values"] == int(tracefp4.unpack_hints(vm).sum())
        assert got["marked_mismatch"] == got["unmarked_mismatch"] == 0  # the rollout's own codes


def test_entropy_floor_is_zero_for_the_rollouts_own_values_and_grows_with_noise():
    """EntropyTally: a trainer holding the rollout's own values needs nothing (the bins' edges are the rounding
    boundaries); one whose values moved needs more the more they moved, at most 4 bits per value and 8 per block."""
    import torch

    import tracefp4
    from tracerl.audit.passes import EntropyTally

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=gen) * torch.exp(torch.randn(64, 1, generator=gen))
    g = torch.tensor(0.5)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g)
    bits = []
    for noise in (0.0, 0.01, 0.1):
        t = EntropyTally(["s"])
        xt = x * (1 + noise * torch.randn(x.shape, generator=gen))
        t.add("s", xt[:30], g, q.codes[:30], q.scales[:30])
        t.add("s", xt[30:], g, q.codes[30:], q.scales[30:])
        f = t.site_floor()["s"]
        assert f["tokens"] == 64 and f["bytes_per_token"] == (f["code_bits_per_token"] + f["scale_bits_per_token"]) / 8
        bits.append((f["code_bits_per_token"], f["scale_bits_per_token"]))
    assert bits[0] == (0.0, 0.0)
    assert 0 < bits[1][0] < bits[2][0] < 4 * 256 and 0 <= bits[1][1] <= bits[2][1] < 8 * 16


def test_joint_pass_encodes_each_unit_at_its_own_point():
    """A joint planner configuration as a pass: bits units as hints from the replay, margin units as margin
    exceptions each at its own point (`PassSpec.site_margins`); passes of one point are unchanged."""
    from tracerl.audit.passes import PassSpec, joint_pass, margin_alone_pass
    from tracerl.audit.plan import SiteGroup
    from tracerl.errors import ConfigError

    units = {n: SiteGroup(n, "moe_input", None, (0, 0), (f"{n}.a", f"{n}.b"), 48) for n in "ABC"}
    margins = [(0.05, 0.05, "byte"), (float("inf"), 0.5, "lsb")]
    spec = joint_pass("joint:3", {"A": "bits", "B": "margin:m=inf ms=0.5 lsb", "C": "margin:m=0.05 ms=0.05"}, units,
                      margins, replay_routes=True)
    assert spec.replay_routes and spec.margin is None
    assert spec.actions == {"A.a": "replay_hints", "A.b": "replay_hints", "B.a": "margin", "B.b": "margin",
                            "C.a": "margin", "C.b": "margin"}
    assert spec.margin_of("B.a") == (1, margins[1]) and spec.margin_of("C.b") == (0, margins[0])
    alone = margin_alone_pass(units["C"], 0, margins[0])
    assert alone.name == "hint:C@m=0.05 ms=0.05" and alone.site_margins == {}
    assert alone.margin_of("C.a") == (0, margins[0]) and alone.actions == {"C.a": "margin", "C.b": "margin"}
    with pytest.raises(ConfigError, match="no margin point"):
        PassSpec("x", actions={"s": "margin"}).margin_of("s")
    with pytest.raises(ConfigError, match="option 'margin:m=1 ms=1'"):
        joint_pass("joint:1", {"A": "margin:m=1 ms=1"}, units, margins)
