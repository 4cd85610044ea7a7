"""References for what a replica must serve: a fresh vLLM engine started on a version's bf16 weights.

For a family of `weightpull.integrations.vllm.tiny` (llama, llama-tied, qwen2, qwen3,
qwen3-moe), `save_versions` writes the bf16 checkpoints of some versions and `references`
runs a fresh engine on each, in a subprocess (`python -m tests.vllm_families PATH...`,
JSON on the last stdout line). Not in the test's process: an in-process engine's CPU
worker changes that process for good (it replaces `torch.set_num_threads` with a no-op,
sets a NUMA memory binding, starts torch.distributed), while the replicas under test are
`AsyncLLM`s, whose engines always run in processes of their own. One subprocess runs its
engines one after another, shutting each down first; `ReferenceProcess` keeps one such
process for many requests (a module's), so that its imports are paid once.

Each prompt's result is `{"tokens": [...], "logprob": first token's logprob, "cached":
prompt tokens served from the prefix cache}`; prompts run one after another, so the
last (the long one again) hits the prefix cache. `serve` / `serve_async` give the same
for an engine under test, and `compare` lists the differences.

    model, base, paths = save_versions("qwen3-moe", tmp_path, versions=(1, 2))
    refs = references([paths[1], paths[2]])          # {str(path): [result per prompt]}
    ... publish version_weights(model, base, 2, names="checkpoint"), apply it ...
    assert compare(refs[str(paths[2])], await serve_async(replica_llm)) == []
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from weightpull.integrations.vllm.tiny import base_weights, make_model, save, version_weights

SHORT = [1, 5, 9, 22, 100, 7]
LONG = [(7 * i + 3) % 1000 + 1 for i in range(100)]  # spans several KV blocks
PROMPTS = {"short": SHORT, "long": LONG, "long-again": LONG}  # in this order: the last hits the prefix cache
TOKENS = 12
# block_size: the CPU backend's default is 128, so a 100-token prompt would fill no block
# and nothing would ever be served from the prefix cache. Pass the same to engines under test.
ENGINE = dict(
    dtype="bfloat16",
    enforce_eager=True,
    skip_tokenizer_init=True,
    kv_cache_memory_bytes=32 << 20,
    max_model_len=256,
    block_size=32,
)


def sampling_params(tokens: int = TOKENS) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=1)


def result(output: Any) -> dict[str, Any]:
    """A finished `RequestOutput` as the harness compares it."""
    out = output.outputs[0]
    tokens = list(out.token_ids)
    return {"tokens": tokens, "logprob": out.logprobs[0][tokens[0]].logprob, "cached": output.num_cached_tokens or 0}


def serve(llm: Any, tokens: int = TOKENS) -> list[dict[str, Any]]:
    """Each prompt through an in-process `vllm.LLM`, one at a time."""
    from vllm.inputs import TokensPrompt

    params = sampling_params(tokens)
    return [
        result(llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]) for p in PROMPTS.values()
    ]


async def serve_async(llm: Any, tokens: int = TOKENS, request_prefix: str = "ref") -> list[dict[str, Any]]:
    """Each prompt through an `AsyncLLM` (the replica under test), one at a time."""
    import uuid

    from vllm.inputs import TokensPrompt

    params, results = sampling_params(tokens), []
    for name, prompt in PROMPTS.items():
        final = None
        request_id = f"{request_prefix}-{name}-{uuid.uuid4().hex[:8]}"
        async for output in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=request_id):
            final = output  # the last holds the whole completion
        results.append(result(final))
    return results


def compare(expected: list[dict[str, Any]], got: list[dict[str, Any]], logprob_tol: float = 0.0) -> list[str]:
    """What differs between two runs of PROMPTS (empty: the same). `cached` is not compared."""
    diffs = []
    for name, e, g in zip(PROMPTS, expected, got, strict=True):
        if e["tokens"] != g["tokens"]:
            diffs.append(f"{name}: tokens {g['tokens']} != {e['tokens']}")
        if abs(e["logprob"] - g["logprob"]) > logprob_tol:
            diffs.append(f"{name}: first-token logprob {g['logprob']} != {e['logprob']}")
    return diffs


def save_versions(
    family: str,
    root: str | Path,
    versions: tuple[int, ...] = (1, 2),
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Any, dict[str, torch.Tensor], dict[int, Path]]:
    """The family's model (left holding the last version), its base weights, and a
    checkpoint directory per version, `root/<family>-v<version>`, cast to `dtype`."""
    model = make_model(family, seed)
    base = base_weights(model)
    paths = {}
    for v in versions:
        version_weights(model, base, v)
        paths[v] = save(model, Path(root) / f"{family}-v{v}", dtype)
    return model, base, paths


def engine(path: str | Path, **overrides: Any) -> Any:
    """A fresh in-process `vllm.LLM` on `path` (run it in a process of its own: see above)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    return LLM(model=str(path), **{**ENGINE, **overrides})


def references(paths: list[str | Path], tokens: int = TOKENS, timeout: float = 300) -> dict[str, list[dict[str, Any]]]:
    """A fresh engine's results on each checkpoint, keyed by `str(path)`: one subprocess."""
    cmd = [sys.executable, "-m", "tests.vllm_families", "--tokens", str(tokens), *map(str, paths)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=Path(__file__).parent.parent
    )
    if done.returncode != 0:
        raise RuntimeError(f"the reference engine failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["results"]


class ReferenceProcess:
    """`references` from one process kept for many requests (a module's tests): its imports
    are paid once, not once a test, and requests made ahead run while the engines under
    test start. Each checkpoint still gets an engine of its own, started fresh, one after
    another in request order (`python -m tests.vllm_families --serve`; a request is one
    stdin line, its answer a JSON file written whole)."""

    def __init__(self, root: str | Path, tokens: int = TOKENS) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log = self.root / "references.log"
        self._requests = 0
        env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.vllm_families", "--serve", "--tokens", str(tokens)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=Path(__file__).parent.parent,
            )

    def submit(self, paths: list[str | Path]) -> Path:
        """Ask for a fresh engine's results on each of `paths`; where they will be (`wait`)."""
        self._requests += 1
        answer = self.root / f"references-{self._requests}.json"
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"paths": [str(p) for p in paths], "out": str(answer)}) + "\n")
        self.proc.stdin.flush()
        return answer

    def wait(self, answer: Path, timeout: float = 300) -> dict[str, list[dict[str, Any]]]:
        """The results `submit` promised at `answer`, keyed by `str(path)` (blocking; polls)."""
        deadline = time.monotonic() + timeout
        while not answer.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"ended ({self.proc.returncode})" if self.proc.poll() is not None else f"not within {timeout} s"
                raise RuntimeError(f"the reference engines {why}:\n{self.log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.05)
        return json.loads(answer.read_text())["results"]

    def references(self, paths: list[str | Path], timeout: float = 300) -> dict[str, list[dict[str, Any]]]:
        return self.wait(self.submit(paths), timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # it ends at EOF
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _run(paths: list[str], tokens: int) -> dict[str, Any]:
    """A fresh engine's results on each of `paths`, one engine after another."""
    results, seconds = {}, {}
    for path in paths:
        started = time.perf_counter()
        llm = engine(path)
        results[path] = serve(llm, tokens)
        seconds[path] = round(time.perf_counter() - started, 2)
        llm.llm_engine.engine_core.shutdown()  # the next engine starts clean
        del llm
    return {"results": results, "seconds": seconds}


def _serve(tokens: int) -> None:
    """`ReferenceProcess`'s side: one request a stdin line, each answer written whole."""
    for line in sys.stdin:
        request = json.loads(line)
        answer = Path(request["out"])
        partial = answer.with_suffix(".part")
        partial.write_text(json.dumps(_run(request["paths"], tokens)))
        partial.rename(answer)


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", help="checkpoint directories")
    parser.add_argument("--serve", action="store_true", help="take requests on stdin (ReferenceProcess)")
    parser.add_argument("--family", help="save this family's versions to a temporary directory first")
    parser.add_argument("--versions", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=TOKENS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.tokens)
        return
    paths = list(args.paths)
    if args.family:
        paths += [str(p) for p in save_versions(args.family, tempfile.mkdtemp(), tuple(args.versions))[2].values()]
    print(json.dumps(_run(paths, args.tokens)))


if __name__ == "__main__":
    _main()
