"""Config slicing, dataset reading and the CLI's early errors (no Ray, no engine)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.batch.data import load_dataset, repeat_for_rollout, rows_to_batch
from agentloop.cli.rollout import build_config, main
from agentloop.config import resolve_config, sampling_params_from_config
from agentloop.errors import ConfigError, DatasetError


def test_trainer_shaped_and_rollout_only_configs_give_same_slices(model_dir):
    trainer = OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(model_dir)},
                                                      "rollout": {"temperature": 0.5}},
                                "data": {"max_prompt_length": 100, "max_response_length": 20}})
    a = resolve_config(trainer)
    assert (
        a.rollout.temperature == 0.5
        and a.rollout.prompt_length == 100
        and a.rollout.response_length == 20
    )
    assert a.rollout.agent.default_agent_loop == "single_turn_agent"
    b = resolve_config(
        {"temperature": 0.5, "prompt_length": 100, "response_length": 20}, model_path=str(model_dir)
    )
    assert OmegaConf.to_container(a.rollout) == OmegaConf.to_container(b.rollout)
    assert b.model_path == str(model_dir)


def test_missing_model_path_fails_fast_with_hint(tmp_path):
    cfg = {"actor_rollout_ref": {"model": {"path": str(tmp_path / "nope")}}}
    with pytest.raises(ConfigError, match="make_tiny_model"):
        resolve_config(cfg)
    with pytest.raises(ConfigError, match="model_path"):
        resolve_config({"temperature": 1.0})


def test_cli_reports_bad_model_path_before_starting_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "rollout", f"actor_rollout_ref.model.path={tmp_path}/missing",
                "data.train_files=x.jsonl",
            ]
        )
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        line.startswith("agentloop: error: actor_rollout_ref.model.path")
        and "is not a directory" in line
    )


def test_bad_values_are_named(model_dir):
    base = {"actor_rollout_ref": {"model": {"path": str(model_dir)}}}
    with pytest.raises(ConfigError, match="prompt_truncation"):
        resolve_config(
            OmegaConf.merge(
                base, {"actor_rollout_ref": {"rollout": {"agent": {"prompt_truncation": "x"}}}}
            )
        )
    with pytest.raises(ConfigError, match="num_workers"):
        resolve_config(
            OmegaConf.merge(base, {"actor_rollout_ref": {"rollout": {"agent": {"num_workers": 0}}}})
        )


def test_sampling_params_follow_verl_keys(model_dir):
    cfg = resolve_config(
        {"temperature": 0.7, "top_p": 0.9, "calculate_log_probs": True}, model_path=str(model_dir)
    )
    p = sampling_params_from_config(cfg.rollout)
    assert p == {
        "temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
    }
    assert sampling_params_from_config(cfg.rollout, validate=True)["temperature"] == 0.0


def test_build_config_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("actor_rollout_ref:\n  rollout:\n    temperature: 0.3\n")
    cfg = build_config(str(f), ["actor_rollout_ref.rollout.top_p=0.5", "+output_dir=/tmp/o"])
    assert cfg.actor_rollout_ref.rollout.temperature == 0.3
    assert cfg.actor_rollout_ref.rollout.top_p == 0.5
    with pytest.raises(ConfigError, match="key=value"):
        build_config(None, ["oops"])


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_jsonl_dataset_to_batch(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "extra_info": {"index": 10 + i},
             "agent_name": "single_turn_agent"} for i in range(3)]
    write_jsonl(tmp_path / "d.jsonl", rows)
    batch = load_dataset(tmp_path / "d.jsonl", n=2)
    assert len(batch) == 6
    assert list(batch.non_tensor_batch["index"]) == [10, 10, 11, 11, 12, 12]
    uids = batch.non_tensor_batch["uid"]
    assert uids[0] == uids[1] and uids[0] != uids[2]
    assert batch.non_tensor_batch["raw_prompt"][0] == [{"role": "user", "content": "q0"}]


def test_parquet_dataset_lists_come_back_as_lists(tmp_path):
    pd = pytest.importorskip("pandas")
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "extra_info": {"index": 0}}]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    batch = load_dataset(tmp_path / "d.parquet")
    assert batch.non_tensor_batch["raw_prompt"][0] == [{"role": "user", "content": "hi"}]
    assert isinstance(batch.non_tensor_batch["raw_prompt"], np.ndarray)


def test_missing_prompt_column_is_named():
    with pytest.raises(DatasetError, match="'prompt'"):
        rows_to_batch([{"question": "hi"}])


GOOD = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "prompt,expected",
    [
        (
            "What is 2+2?",
            'prompt must be a list of {role, content} messages, got str "What is 2+2?"',
        ),
        (
            {"role": "user", "content": "hi"},
            "prompt must be a list of {role, content} messages, got dict",
        ),
        ([], "prompt is an empty list"),
        ([GOOD, "hello"], 'prompt message 1 is not a {role, content} dict, got str "hello"'),
        ([{"content": "hi"}], "prompt message 0 has no string 'role' (got NoneType None)"),
        (
            [{"role": "user", "content": 5}],
            "prompt message 0 (user) content must be a string or "
            "a list of content "
            "parts, got int 5",
        ),
        ([{"role": "user", "content": None}], "prompt message 0 (user) has no content"),
        ([{"role": "assistant", "content": None}], "prompt message 0 (assistant) has no content"),
        (
            [{"role": "user", "content": ["hi"]}],
            "prompt message 0 (user) content part 0 must be a dict with a string 'type'",
        ),
    ],
)
def test_malformed_prompts_are_named_by_file_row_and_what_was_found(tmp_path, prompt, expected):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [{"prompt": [GOOD]}, {"prompt": [GOOD]}, {"prompt": prompt}])
    with pytest.raises(DatasetError) as e:
        load_dataset(path)
    assert str(e.value).startswith(f"{path} row 2 (line 3): {expected}")
    # rows built in Python are checked the same way
    with pytest.raises(DatasetError, match="^dataset row 0: "):
        rows_to_batch([{"prompt": prompt}])


def test_well_formed_prompt_shapes_are_accepted(tmp_path):
    prompts = [
        [{"role": "system", "content": "be brief"}, GOOD],
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "what is this"}, {"type": "image"}],
            }
        ],
        [
            GOOD,
            {
                "role": "assistant", "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "42"},
        ],
    ]
    batch = rows_to_batch([{"prompt": p} for p in prompts])
    assert list(batch.non_tensor_batch["raw_prompt"]) == prompts


def test_parquet_rows_are_checked_by_row_number(tmp_path):
    pd = pytest.importorskip("pandas")
    rows = [{"prompt": [GOOD]}] * 7 + [{"prompt": [{"role": "user", "content": None}]}]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    with pytest.raises(
        DatasetError, match=r"train.parquet row 7: prompt message 0 \(user\) " r"has no content"
    ):
        load_dataset(tmp_path / "train.parquet")


def test_max_samples_checks_only_the_rows_it_keeps(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": [GOOD]}, {"prompt": "bad"}])
    assert len(load_dataset(tmp_path / "d.jsonl", max_samples=1)) == 1


def test_unreadable_empty_and_missing_datasets_say_what_to_fix(tmp_path):
    cases = {
        "missing.jsonl": (None, "does not exist: check data.train_files"),
        "empty.jsonl": ("\n\n", "has no rows"),
        "broken.parquet": ("not a parquet file", "cannot read it as parquet"),
        "bad.jsonl": ('{"prompt": [}\n', "bad.jsonl:1: not valid JSON"),
        "list.jsonl": ("[1, 2]\n", "list.jsonl:1: a row must be a JSON object"),
        "latin1.jsonl": (b"\xff\xfe{", "cannot read it as UTF-8 text"),
        "d.csv": ("prompt\nhi\n", "unsupported extension '.csv'; use .parquet or .jsonl"),
    }
    for name, (content, expected) in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        with pytest.raises(DatasetError) as e:
            load_dataset(path)
        assert expected in str(e.value), name
        assert "\n" not in str(e.value)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DatasetError, match="is not a file"):
        load_dataset(tmp_path / "dir.jsonl")
    write_jsonl(tmp_path / "q.jsonl", [{"question": "hi"}])
    with pytest.raises(
        DatasetError,
        match=r"q.jsonl row 0 \(line 1\) has no 'prompt' "
        r"column; columns present: "
        r"\['question'\]. Set data.prompt_key",
    ):
        load_dataset(tmp_path / "q.jsonl")


def test_repeat_for_rollout_adds_one_uid_per_prompt_and_interleaves():
    """verl's trainer contract: a uid per prompt, then ``repeat(n, interleave=True)``."""
    import torch
    from tensordict import TensorDict

    from agentloop.batch.protocol import DataProto

    batch = DataProto(batch=TensorDict({"x": torch.arange(3)}, batch_size=[3]),
                      non_tensor_batch={"raw_prompt": np.array(["a", "b", "c"], dtype=object)},
                      meta_info={"global_steps": 7})
    out = repeat_for_rollout(batch, 2)
    assert len(out) == 6 and out.meta_info == {"global_steps": 7}
    assert list(out.non_tensor_batch["raw_prompt"]) == ["a", "a", "b", "b", "c", "c"]
    assert out.batch["x"].tolist() == [0, 0, 1, 1, 2, 2]
    uids = list(out.non_tensor_batch["uid"])
    assert uids[0] == uids[1] != uids[2] == uids[3] != uids[4] == uids[5] and len(set(uids)) == 3
    assert all(isinstance(u, str) for u in uids)
    assert "uid" not in batch.non_tensor_batch  # the input is left as it was


def test_repeat_for_rollout_keeps_existing_uids_and_checks_n():
    batch = rows_to_batch([{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(2)])
    uids = list(batch.non_tensor_batch["uid"])
    out = repeat_for_rollout(batch, 3)
    assert list(out.non_tensor_batch["uid"]) == [uids[0]] * 3 + [uids[1]] * 3
    assert repeat_for_rollout(batch, 1) is batch
    assert len(repeat_for_rollout(batch, np.int64(2))) == 4
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(DatasetError, match="positive int"):
            repeat_for_rollout(batch, bad)


def test_server_priority_is_reset_from_rays_nice_15_in_all_threads():
    """Ray starts actors at nice 15; a server resets its threads to 0 before spawning the engine
    (or, without the privilege, says so and how to fix it)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, threading
        os.nice(15)
        threading.Thread(target=lambda: __import__("time").sleep(2), daemon=True).start()
        from agentloop.cluster.placement import restore_normal_priority
        from agentloop.config import EngineConfig
        print(restore_normal_priority(False), os.getpriority(os.PRIO_PROCESS, 0))
        print(restore_normal_priority(EngineConfig.from_rollout({}).normal_priority))  # on by default
        print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    disabled, summary, nices = out.stdout.strip().splitlines()[-3:]
    assert disabled == "unchanged (rollout.normal_priority=false) 15"
    if os.geteuid() == 0:
        assert summary == "nice 15 -> 0" and nices == "[0]"
    else:
        assert "could not reset" in summary and "RAY_worker_niceness=0" in out.stderr
