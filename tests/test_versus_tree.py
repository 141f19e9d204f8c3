"""scripts/bench/versus_tree.py: two trees' runs summed up right, and a whole study through the CLI."""

import json

import pytest

from scripts.bench import versus_tree


def run(tree, mode, tok_s, digest="d1", setting="sampled", workload="prose"):
    return dict(setting=setting, tree=tree, workload=workload, mode=mode, tokens_per_s=tok_s, digest=digest)


def test_summary_takes_medians_a_tree_and_their_ratio():
    runs = [run("old", "serial", t) for t in (10.0, 30.0, 20.0)] + [run("new", "serial", t) for t in (45.0, 40.0, 50.0)]
    (row,) = versus_tree.summarize(runs, ["old", "new"])
    assert row["median_tokens_per_s"] == {"old": 20.0, "new": 45.0}
    assert row["ratio"] == pytest.approx(2.25)
    assert row["runs"] == {"old": 3, "new": 3}
    assert row["same_text"] is True


def test_summary_tells_texts_apart():
    differ = versus_tree.summarize([run("old", "3", 1.0, "a"), run("new", "3", 1.0, "b")], ["old", "new"])
    assert differ[0]["same_text"] is False
    # a tree whose own runs wrote two texts is no match either, even if the other wrote both
    mixed = [run("old", "3", 1.0, "a"), run("old", "3", 1.0, "b"), run("new", "3", 1.0, "a"), run("new", "3", 1.0, "b")]
    assert versus_tree.summarize(mixed, ["old", "new"])[0]["same_text"] is False
    # prefill rows carry no text
    prefill = versus_tree.summarize([run("old", "prefill", 5.0, None), run("new", "prefill", 6.0, None)], ["old", "new"])
    assert "same_text" not in prefill[0]


def test_summary_keeps_the_settings_order_and_a_settings_own_mode_order():
    runs = [run("old", "prefill", 1.0, None, setting="prefill"), run("old", "serial", 1.0, setting="streamed"),
            run("old", "3", 1.0), run("old", "serial", 1.0)]
    rows = versus_tree.summarize(runs, ["old", "new"])
    assert [(r["setting"], r["mode"]) for r in rows] == [
        ("sampled", "3"), ("sampled", "serial"), ("streamed", "serial"), ("prefill", "prefill")]
    assert all("ratio" not in r for r in rows)  # one tree only


def test_a_study_of_this_tree_against_itself(tmp_path, capsys):
    out = tmp_path / "versus.json"
    code = versus_tree.main(["--base-dir", str(versus_tree.ROOT), "--settings", "sampled", "--workloads", "prose",
                             "--modes", "serial", "--rounds", "1", "--repeats", "1", "--warmup", "0",
                             "--max-tokens", "8", "--dir", str(tmp_path / "work"), "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    serial = [r for r in result["summary"] if r["mode"] == "serial"]
    assert len(serial) == 1 and serial[0]["runs"] == {"old": 1, "new": 1}
    assert serial[0]["same_text"] is True  # one tree, one seed: one text
    assert "| sampled | prose | serial |" in capsys.readouterr().out


def test_a_folder_without_the_package_is_refused_in_one_line(tmp_path, capsys):
    code = versus_tree.main(["--base-dir", str(tmp_path), "--settings", "sampled", "--dir", str(tmp_path / "work")])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "old: imports strata_cli from" in err[0]


def test_unknown_settings_are_refused():
    with pytest.raises(SystemExit):
        versus_tree.main(["--settings", "greedy,fast"])


def test_warm_prompt_prefills_and_the_launch_to_first_token(tmp_path):
    out = tmp_path / "versus.json"
    code = versus_tree.main(["--base-dir", str(versus_tree.ROOT), "--settings", "prompts,first-token",
                             "--workloads", "prose", "--rounds", "1", "--repeats", "2",
                             "--dir", str(tmp_path / "work"), "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    prompts = [r for r in result["runs"] if r["setting"] == "prompts"]
    # each tree prefilled the prompt three times and kept the last two (the first warmed its shape)
    assert sorted(r["tree"] for r in prompts) == ["new", "new", "old", "old"]
    assert all(r["mode"].startswith("prefill of ") and r["tokens_per_s"] > 0 for r in prompts)
    (launch_old, launch_new) = sorted((r for r in result["runs"] if r["setting"] == "first-token"),
                                      key=lambda r: r["tree"], reverse=True)
    assert launch_old["tree"] == "old" and 0 < launch_new["seconds"] < 120
