"""``kvsvc plan``: every bundled config in both output forms, the exit statuses, the flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvsvc.cli import main
from kvsvc.models import (
    ModelSpecOptions,
    bundled_config_path,
    dump_spec_file,
    layer_specs_for_rank,
    list_bundled_configs,
    load_model_config,
)
from kvsvc.specs import MLAAttentionSpec, SlidingWindowMLASpec

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    rc, out, err = run(capsys, *args, "--json")
    assert rc == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


@pytest.mark.parametrize("name", list_bundled_configs())
def test_every_bundled_config_plans_in_both_forms(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    rc, out, err = run(capsys, "--model-config", name, "--kv-cache-memory", "80GiB")
    assert rc == 0, err
    assert "KV cache groups" in out and "Max concurrency:" in out
    data = plan_json(capsys, "--model-config", name, "--kv-cache-memory", "80GiB")
    for key in ("num_blocks", "block_size", "max_model_len", "kv_cache_tokens", "max_concurrency"):
        assert key in data
    assert data["max_model_len"] > 0 and data["num_blocks"] > 1
    layers = [n for g in data["groups"] for n in g["layer_names"]]
    assert len(layers) == len(set(layers)) > 0
    assert {g["kind"] for g in data["groups"]} <= {
        "full_attention",
        "sliding_window",
        "mla_attention",
        "mamba",
        "cross_attention",
    }
    (worker,) = data["workers"]
    assert worker["num_blocks"] == data["num_blocks"]
    assert sorted(n for t in worker["tensors"] for n in t["layers"]) == sorted(layers)
    assert worker["allocated_bytes"] <= 80 * 2**30
    assert f"{data['num_blocks']:,}" in out


def test_llama_1b_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, "--model-config", "llama-3.2-1b", "--kv-cache-memory", "8GiB")
    # 16 layers of 16 * 8 * (64 + 64) * 2 = 32768 B pages: 512 KiB a block, 16384 blocks;
    # a 131072-token request takes 8192 of them
    assert data["num_blocks"] == 16384
    assert data["block_size"] == data["hash_block_size"] == 16
    assert data["max_model_len"] == 131072
    assert data["max_concurrency"] == 2.0
    assert data["kv_cache_tokens"] == 262144
    (group,) = data["groups"]
    assert (group["kind"], group["page_size_bytes"], group["num_layers"]) == (
        "full_attention",
        32768,
        16,
    )
    tensors = data["workers"][0]["tensors"]
    assert len(tensors) == 16
    assert tensors[3] == {
        "size": 32768 * 16384,
        "layers": ["model.layers.3.self_attn.attn"],
        "offset": 0,
        "block_stride": 0,
        "page_stride": 32768,
    }


def test_table_form(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(
        capsys,
        "--model-config",
        "gemma-2-9b",
        "--tp",
        "2",
        "--pp",
        "2",
        "--kv-cache-memory",
        "10GiB",
    )
    assert rc == 0
    assert out.splitlines()[0] == (
        "Model: gemma-2-9b (gemma2)  TP=2 PP=2  dtype=bfloat16  kv-cache=bfloat16"
    )
    assert "sliding_window" in out and "4096" in out
    # 4 ranks listed, with their stage and TP index
    rank_rows = [line.split() for line in out.splitlines() if line.startswith("  3 ")]
    assert rank_rows and rank_rows[0][:3] == ["3", "1", "1"]


def test_auto_fit_and_the_memory_error(capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(
        capsys,
        "--model-config",
        "llama-3.1-8b",
        "--kv-cache-memory",
        "8GiB",
        "--max-model-len",
        "-1",
    )
    # 128 KiB per token; 8 GiB less the null block (2 MiB) hold 65520 tokens
    assert data["max_model_len"] == 65520
    rc, out, err = run(capsys, "--model-config", "llama-3.1-8b", "--kv-cache-memory", "8GiB")
    assert rc == 1
    assert out == ""
    assert "max_model_len 131072 tokens (--max-model-len), 16.00 GiB of KV cache is needed" in err
    assert "--kv-cache-memory" in err and "https://" not in err
    assert "the estimated maximum model length is 65520" in err


def test_memory_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("--model-config", "llama-3.2-1b")
    # 80 GiB * 0.5 - 32 GiB = 8 GiB, as --kv-cache-memory 8GiB
    data = plan_json(
        capsys,
        *base,
        "--gpu-memory",
        "80GiB",
        "--gpu-memory-utilization",
        "0.5",
        "--non-kv-memory",
        "32GiB",
    )
    assert data["num_blocks"] == 16384
    # per-rank sizes: the smaller stage decides
    data = plan_json(
        capsys, *base, "--pp", "2", "--kv-cache-memory", "8GiB,4GiB", "--max-model-len", "1024"
    )
    assert [w["num_blocks"] for w in data["workers"]] == [16384, 16384]
    assert data["workers"][1]["available_memory"] == 4 * 2**30
    # an override needs no memory figure
    data = plan_json(capsys, *base, "--num-gpu-blocks-override", "100", "--max-model-len", "1024")
    assert data["num_blocks"] == 100


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--kv-cache-memory", "8GiB", "--gpu-memory", "80GiB"), "not both"),
        ((), "say how much memory the KV cache gets"),
        (("--pp", "2", "--kv-cache-memory", "1GiB,2GiB,3GiB"), "lists 3 sizes for 2 ranks"),
        (
            ("--tp", "3", "--kv-cache-memory", "8GiB"),
            "num_attention_heads=32 is not divisible by tp=3",
        ),
    ],
)
def test_bad_flag_combinations_exit_2(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    rc, out, err = run(capsys, "--model-config", "llama-3.2-1b", *args)
    assert rc == 2
    assert out == ""
    assert err.startswith("kvsvc plan: error: ")
    assert message in err


@pytest.mark.parametrize(
    "args",
    [
        ("--model-config", "llama-3.2-1b", "--tp", "0"),
        ("--model-config", "llama-3.2-1b", "--kv-cache-memory", "4XB"),
        ("--model-config", "llama-3.2-1b", "--max-model-len", "-2"),
        ("--model-config", "llama-3.2-1b", "--gpu-memory-utilization", "1.5"),
        ("--model-config", "x", "--spec-file", "y"),
        ("--kv-cache-memory", "8GiB"),
    ],
)
def test_malformed_flags_exit_2(capsys: pytest.CaptureFixture[str], args: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", *args])
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_unknown_model_name_lists_the_bundled_ones(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "--model-config", "gpt-9", "--kv-cache-memory", "8GiB")
    assert rc == 2
    assert "no bundled config named 'gpt-9'; bundled: " in err and "llama-3.2-1b" in err


def test_list_models(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--list-models")
    assert rc == 0
    assert out.split() == list_bundled_configs()


def test_model_config_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = load_model_config(bundled_config_path("qwen3-8b"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = plan_json(capsys, "--model-config", str(tmp_path), "--kv-cache-memory", "20GiB")
    assert data["max_model_len"] == 40960


def test_spec_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    specs = layer_specs_for_rank(
        load_model_config(bundled_config_path("gemma-2-9b")), ModelSpecOptions(), 0
    )
    path = tmp_path / "specs.json"
    dump_spec_file(specs, path)
    data = plan_json(
        capsys,
        "--spec-file",
        str(path),
        "--pp",
        "2",
        "--max-model-len",
        "8192",
        "--kv-cache-memory",
        "10GiB",
    )
    assert [len(w["groups"][0]) + len(w["groups"][1]) for w in data["workers"]] == [21, 21]
    assert data["max_model_len"] == 8192
    rc, _, err = run(capsys, "--spec-file", str(path), "--kv-cache-memory", "10GiB")
    assert rc == 2 and "--spec-file needs --max-model-len" in err


def test_block_outer_layout_for_pages_that_cannot_be_unified(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    specs = {}
    for i in range(3):
        specs[f"model.layers.{i}.attn"] = MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=576, dtype="float32"
        )
        specs[f"model.layers.{i}.indexer"] = MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=132, dtype="uint8"
        )
    for i in range(3, 8):
        specs[f"model.layers.{i}.attn"] = SlidingWindowMLASpec(
            block_size=16, num_kv_heads=1, head_size=1024, dtype="float32", sliding_window=128
        )
    path = tmp_path / "specs.json"
    dump_spec_file(specs, path)  # type: ignore[arg-type]
    args = ("--spec-file", str(path), "--max-model-len", "1024", "--kv-cache-memory", "1GiB")
    rc, _, err = run(capsys, *args)
    assert rc == 1 and "kvsvc plan --layout block_outer" in err
    data = plan_json(capsys, *args, "--layout", "block_outer")
    assert data["layout"] == "block_outer"
    assert [g["num_layers"] for g in data["groups"]] == [6, 3, 2]
    assert {t["block_stride"] for t in data["workers"][0]["tensors"]} == {3 * 65536}


def test_model_specific_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    whisper = plan_json(capsys, "--model-config", "whisper-large-v3", "--kv-cache-memory", "2GiB")
    assert whisper["sizing"]["max_num_encoder_input_tokens"] == 1500
    assert {g["kind"] for g in whisper["groups"]} == {"full_attention", "cross_attention"}
    # Mamba cache mode "none" keeps no per-block state: no prefix caching, so hashes are
    # taken at the scheduler block size
    jamba = plan_json(capsys, "--model-config", "jamba-v0.1", "--kv-cache-memory", "30GiB")
    assert jamba["hash_block_size"] == jamba["block_size"]
    deepseek = plan_json(
        capsys,
        "--model-config",
        "deepseek-v2-lite",
        "--tp",
        "2",
        "--kv-cache-memory",
        "8GiB",
        "--kv-cache-dtype",
        "fp8",
    )
    assert deepseek["tp_replicas"] == 2
    assert deepseek["groups"][0]["page_size_bytes"] == 16 * 576
    merged = plan_json(
        capsys,
        "--model-config",
        "gemma-2-9b",
        "--kv-cache-memory",
        "10GiB",
        "--disable-hybrid-kv-cache-manager",
    )
    assert [g["kind"] for g in merged["groups"]] == ["full_attention"]


def test_python_dash_m_kvsvc_plan() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsvc",
            "plan",
            "--model-config",
            "llama-3.2-1b",
            "--kv-cache-memory",
            "5GiB",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    # 5 GiB / 512 KiB = 10240 blocks; a full-length request takes 8192 (4 GiB would leave
    # 8191 usable besides the null block: one short)
    assert data["num_blocks"] == 10240
    assert data["max_concurrency"] == 1.25
