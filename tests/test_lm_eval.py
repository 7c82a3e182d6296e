"""EleutherAI's lm-evaluation-harness as a client (#76): its ``local-completions`` model
against a real hetspecd over TCP (loopback, with a bearer token) on a log-likelihood task and a
generation task the test writes, and the same harness on the same model through transformers
in-process. The accuracies, each answer's log-likelihood (within 1e-3 a token) and the
generated texts must agree: on the bundled target, and on the real one (SmolLM2-135M-Instruct,
its folder holding the publisher's Q4_1 weights dequantized) where it can be had.

lm-eval pulls ~37 packages, so it is in no extra: the module skips, saying so, where it or
what its ``hf`` and API models need (accelerate, tenacity) is missing:
``pip install "lm-eval[hf,api]"``."""

from __future__ import annotations

import json
import secrets
import socket

import httpx
import pytest
import transformers
from test_daemon import clean_env

from hetspec.client.daemon_process import DaemonProcess
from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.models.smollm2 import RealModelError, ensure_smollm2

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed (pip install lm-eval)"
)
# lm-eval[hf]'s accelerate (the reference, the `hf` model) and lm-eval[api]'s tenacity
for _extra in ("accelerate", "tenacity"):
    pytest.importorskip(_extra, reason=f"lm-eval's models need {_extra} (lm-eval[hf,api])")
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = pytest.mark.process

PER_TOKEN = 1e-3  # the bound on a log-likelihood, per token scored
CHOICE_TASK, GENERATION_TASK = "hetspec_python_choice", "hetspec_python_continuation"

# A question, its choices (the harness puts a space before each) and the right one's index:
# Python the bundled code model has preferences about.
CHOICES = [
    ("import numpy as", ["np", "pd", "plt", "tf"], 0),
    ("try:\n    import json\nexcept", ["ImportError:", "KeyError:", "finally:"], 0),
    ("if __name__ ==", ["'__main__':", "'main':", "__main__:", "1:"], 0),
    ("def read(path):\n    with open(path) as", ["f:", "file", "path:", "1:"], 0),
    ("for i in", ["range(10):", "ranges 10:", "in range:", "10 range"], 0),
    ("class Point:\n    def __init__(self,", ["x, y):", "self):", "x y)", "):"], 0),
    ("def size(items):\n    return", ["len(items)", "size items", "items len", "len items)"], 0),
    ("x = [1, 2, 3]\nprint(", ["x)", "x]", "x}", "]x"], 0),
]
# A prompt, where the continuation stops, and the continuation the metric expects
CONTINUATIONS = [
    ("try:\n    import json\nexcept", " ImportError:"),
    ("if __name__ ==", " '__main__':"),
    ("def read_lines(path):\n    with open(path) as f:\n        return", " f.read()"),
    ("class Stack(", "object):"),
    ("import os\nimport", " sys"),
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _write_tasks(folder) -> None:
    """Two task configs over jsonl files (``dataset_path: json``: no network)."""
    rows = {
        "choice": [{"question": q, "choices": c, "answer": a} for q, c, a in CHOICES],
        "continuation": [{"prompt": p, "target": t} for p, t in CONTINUATIONS],
    }
    for name, items in rows.items():
        with open(folder / f"{name}.jsonl", "w") as out:
            out.writelines(json.dumps(item) + "\n" for item in items)

    def dataset(name: str) -> dict:
        files = {"test": str(folder / f"{name}.jsonl")}
        return {"data_files": files, "cache_dir": str(folder / "datasets")}

    # JSON is YAML: the configs are written with json.dumps
    choice = {
        "task": CHOICE_TASK,
        "dataset_path": "json",
        "dataset_kwargs": dataset("choice"),
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    continuation = {
        "task": GENERATION_TASK,
        "dataset_path": "json",
        "dataset_kwargs": dataset("continuation"),
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{target}}",
        "generation_kwargs": {
            "until": ["\n"],
            "max_gen_toks": 24,
            "do_sample": False,
            "temperature": 0,
        },
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    (folder / "choice.yaml").write_text(json.dumps(choice, indent=1))
    (folder / "continuation.yaml").write_text(json.dumps(continuation, indent=1))


def _evaluate(lm, folder) -> dict:
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=[CHOICE_TASK, GENERATION_TASK],
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    _write_tasks(folder)
    return folder


@pytest.fixture(scope="module", params=["bundled", "smollm2"])
def target(request) -> dict:
    """The served target's folder (what transformers reads), and the daemon's settings that
    name it (none: the bundled pair, hetspecd's default)."""
    if request.param == "bundled":
        return {"name": "bundled", "folder": BUNDLED_MODELS / "target", "settings": {}}
    try:
        real = ensure_smollm2(quiet=True)
    except RealModelError as error:
        pytest.skip(f"SmolLM2 cannot be had here: {error}")
    settings = {"target.folder": str(real.folder), "target.gguf": str(real.gguf)}
    return {"name": "smollm2", "folder": real.folder, "settings": settings}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, target):
    """hetspecd on the target (the bundled one with its draft; SmolLM2 alone), verifying with
    the target's folder in torch in float32 on the CPU (the weights transformers reads: the
    bundled target's default q8_0 GGUF moves a log-probability by up to ~0.04), on TCP
    127.0.0.1 with a token."""
    folder = tmp_path_factory.mktemp("daemon")
    token = secrets.token_hex(16)
    token_file = folder / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    port = _free_port()
    settings = {
        **target["settings"],
        "gpu_runtime": "torch",
        "gpu_worker.device": "cpu",
        "gpu_worker.dtype": "float32",
        "tcp.listen": f"127.0.0.1:{port}",
        "tcp.token_file": str(token_file),
    }
    argv = [item for k, v in settings.items() for item in ("--set", f"{k}={json.dumps(v)}")]
    daemon = DaemonProcess(folder, *argv, env=clean_env())
    try:
        daemon.wait_ready(180)
        daemon.port, daemon.token = port, token
        yield daemon
    finally:
        assert daemon.stop() == 0


@pytest.fixture(scope="module")
def through_transformers(tasks, target) -> dict:
    """The harness's own ``hf`` model on the target's folder, in float32 on the CPU. Without
    a BOS: the harness sends a server's tokenizer's ids with no special tokens, and the
    folder's tokenizer would add one."""
    lm = get_model("hf")(
        pretrained=str(target["folder"]),
        dtype="float32",
        device="cpu",
        batch_size=1,
        add_bos_token=False,
    )
    return _evaluate(lm, tasks)


@pytest.fixture(scope="module")
def through_hetspecd(daemon, tasks) -> dict:
    """``local-completions`` against the daemon, with the daemon's tokenizer (found at
    ``/tokenizer_info`` and ``/tokenize``) and its token (``OPENAI_API_KEY`` for completions,
    ``auth_token`` for the tokenizer endpoints)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPENAI_API_KEY", daemon.token)
        lm = get_model("local-completions")(
            model="hetspec-demo",
            base_url=f"http://127.0.0.1:{daemon.port}/v1/completions",
            auth_token=daemon.token,
            tokenizer_backend="auto",
            num_concurrent=1,
            max_retries=1,
            timeout=60,
        )
        assert lm.tokenizer_backend == "remote"  # the daemon's tokenizer, detected
        return _evaluate(lm, tasks)


def test_the_listener_needs_the_token_the_harness_sent(daemon, through_hetspecd) -> None:
    base = f"http://127.0.0.1:{daemon.port}"
    for path in ("/tokenizer_info", "/v1/models"):
        assert httpx.get(base + path).status_code == 401
        bearer = {"Authorization": f"Bearer {daemon.token}"}
        assert httpx.get(base + path, headers=bearer).status_code == 200


def _samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def test_the_accuracies_equal_those_through_transformers(
    through_transformers, through_hetspecd, target
) -> None:
    for task, metric in ((CHOICE_TASK, "acc,none"), (GENERATION_TASK, "exact_match,none")):
        expected = through_transformers["results"][task][metric]
        got = through_hetspecd["results"][task][metric]
        print(f"{task} {metric}: transformers {expected}, hetspecd {got}")
        assert got == expected
        assert len(_samples(through_hetspecd, task)) == len(
            CHOICES if task == CHOICE_TASK else CONTINUATIONS
        )
    # the task measures something: the bundled code model is neither always right nor always
    # wrong (SmolLM2 gets every choice right)
    accuracy = through_transformers["results"][CHOICE_TASK]["acc,none"]
    assert 0 < accuracy < 1 if target["name"] == "bundled" else accuracy > 0.5


def test_each_answers_log_likelihood_within_a_thousandth_per_token(
    through_transformers, through_hetspecd, target
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(target["folder"])

    def count(context: str, continuation: str) -> int:
        # the harness's split: the whole's tokens after the context's
        whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
        return len(whole) - len(tokenizer(context, add_special_tokens=False).input_ids)

    worst = 0.0
    expected_samples = _samples(through_transformers, CHOICE_TASK)
    got_samples = _samples(through_hetspecd, CHOICE_TASK)
    for expected, got in zip(expected_samples, got_samples, strict=True):
        assert got["arguments"] == expected["arguments"]
        for (context, continuation), [(want, want_greedy)], [(have, have_greedy)] in zip(
            expected["arguments"], expected["resps"], got["resps"], strict=True
        ):
            tokens = count(context, continuation)
            assert tokens >= 1
            assert abs(have - want) <= PER_TOKEN * tokens, (context, continuation, have, want)
            assert have_greedy == want_greedy, (context, continuation)
            worst = max(worst, abs(have - want) / tokens)
    print(f"largest log-likelihood difference: {worst:.2e} a token")


def test_the_generations_are_the_same_text(through_transformers, through_hetspecd) -> None:
    expected = [s["resps"] for s in _samples(through_transformers, GENERATION_TASK)]
    got = [s["resps"] for s in _samples(through_hetspecd, GENERATION_TASK)]
    print("generated:", got)
    assert got == expected
    assert all(text[0][0] for text in got)  # something was generated
