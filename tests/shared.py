"""What several test files check alike (not collected: no test_ prefix): the engine against
transformers' own model of a checkpoint, and a `pwctl serve` subprocess on a free port."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from pwctl.build import tiny
from pwctl.policy import parse_policy
from pwctl.runtime.engine.engine import Engine


def kl_per_token(engine: Engine, ids: torch.Tensor, policy: str) -> float:
    """Mean KL(fp16 || policy) of the engine's next-token distributions over `ids`."""
    engine.set_policy(parse_policy("fp16"))
    ref = torch.log_softmax(engine.logits(ids), -1)
    engine.set_policy(parse_policy(policy))
    out = torch.log_softmax(engine.logits(ids), -1)
    return float((ref.exp() * (ref - out)).sum(-1).mean())


def assert_matches_transformers(engine: Engine, checkpoint: Path) -> None:
    """fp16 logits equal transformers' to 1e-4, greedy tokens are its generate's, KL at 8 bits
    is below 1e-3 and falls strictly from 2 to 6 bits."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(1, tiny.VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = source(ids).logits
    assert ref.std() > 1.0, "test model's logits should be far from uniform"
    engine.set_policy(parse_policy("fp16"))
    torch.testing.assert_close(engine.logits(ids), ref, rtol=1e-4, atol=1e-4)

    prompt = ids[0, :8].tolist()
    with torch.no_grad():
        theirs = source.generate(
            ids[:1, :8],
            attention_mask=torch.ones(1, 8, dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )[0, 8:]
    assert engine.generate_ids(prompt, 12) == theirs.tolist()

    assert kl_per_token(engine, ids, "uniform:8") < 1e-3
    kls = [kl_per_token(engine, ids, f"uniform:{b}") for b in range(2, 7)]
    assert all(a > b for a, b in zip(kls, kls[1:], strict=False)), kls


def free_port() -> int:
    """A local TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(pack: Path, *options: str, seconds: float = 180) -> Iterator[str]:
    """`pwctl serve PACK --device cpu OPTIONS` on a free port, until /health answers; yields
    its URL and stops it after."""
    port = free_port()
    cmd = [sys.executable, "-m", "pwctl.cli", "serve", str(pack), "--port", str(port),
           "--device", "cpu", *options]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + seconds
        while True:
            assert server.poll() is None, server.communicate()[0]
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
