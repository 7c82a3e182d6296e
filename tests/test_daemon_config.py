"""Configuration layering and core splitting: pure functions, no processes."""

from __future__ import annotations

import asyncio

import pytest

from hetspec.daemon.config import BUNDLED_MODELS, ConfigError, load_config, parse_value
from hetspec.daemon.supervision.cores import (
    CoreError,
    check_cores,
    daemon_cores,
    owned_cores,
    split_cores,
)
from hetspec.daemon.supervision.slots import SlotError, SlotPool
from hetspec.daemon.supervision.supervisor import worker_specs
from hetspec.protocol.worker_messages import MatmulTiling


def test_defaults_serve_the_bundled_models_without_any_file() -> None:
    config = load_config(environ={})
    assert config.target.folder == str(BUNDLED_MODELS / "target")
    assert config.draft.gguf == str(BUNDLED_MODELS / "draft" / "draft-q8_0.gguf")
    assert (config.socket, config.placement) == ("/run/hetspec/hetspecd.sock", "draft-cpu")


def test_file_then_environment_then_flags(tmp_path) -> None:
    path = tmp_path / "hetspecd.toml"
    path.write_text('socket = "/a.sock"\nplacement = "draft-gpu"\n[cpu_worker]\nn_batch = 64\n')
    environ = {
        "HETSPEC_SOCKET": "/b.sock",
        "HETSPEC_CPU_WORKER__CORES": "[0, 1]",
        "HETSPEC_CONFIG": str(path),
    }
    config = load_config(environ=environ, overrides={"socket": "/c.sock"})
    assert (config.socket, config.placement) == ("/c.sock", "draft-gpu")
    assert (config.cpu_worker.n_batch, config.cpu_worker.cores) == (64, [0, 1])


@pytest.mark.parametrize(
    ("contents", "environ", "message"),
    [
        (
            "[cpu_worker]\nn_batch = 'x'\n",
            {},
            "cpu_worker.n_batch: expected `int`, got `str` (FILE)",
        ),
        ("[cpu_worker]\nspeed = 3\n", {}, "cpu_worker.speed: unknown setting (FILE)"),
        (
            "placement = 'gpu'\n",
            {},
            "placement: invalid enum value 'gpu'; one of: draft-cpu, draft-gpu (FILE)",
        ),
        (
            "",
            {"HETSPEC_LOG_LEVEL": "loud"},
            "log_level: invalid enum value 'loud'; one of: debug, info, warning, error "
            "(environment variable HETSPEC_LOG_LEVEL)",
        ),
        (  # a runtime's setting: refused as the configuration is read, the choices listed
            "[cpu_worker]\nflash_attention = 'maybe'\n",
            {},
            "cpu_worker.flash_attention: invalid enum value 'maybe'; one of: auto, on, off (FILE)",
        ),
        (
            "",
            {"HETSPEC_GPU_WORKER__DTYPE": "fp8"},
            "gpu_worker.dtype: invalid enum value 'fp8'; one of: auto, float32, bfloat16, "
            "float16 (environment variable HETSPEC_GPU_WORKER__DTYPE)",
        ),
        (
            "daemon_spin_us = -1\n",
            {},
            "daemon_spin_us: must be in 0..100000, not -1.0 (FILE)",
        ),
        ("socket = \n", {}, "FILE is not valid TOML"),
        ("", {"HETSPEC_BOGUS": "1"}, "bogus: unknown setting (environment variable HETSPEC_BOGUS)"),
        (
            "",
            {"HETSPEC_HEARTBEAT_TIMEOUT_S": "0.5"},
            "heartbeat_timeout_s: must exceed two heartbeat_s intervals "
            "(environment variable HETSPEC_HEARTBEAT_TIMEOUT_S)",
        ),
    ],
)
def test_bad_settings_name_the_key_and_where_it_came_from(tmp_path, contents, environ, message):
    path = tmp_path / "hetspecd.toml"
    path.write_text(contents)
    with pytest.raises(ConfigError) as error:
        load_config(path, environ=environ)
    assert str(error.value).startswith(message.replace("FILE", str(path)))


def test_an_explicit_file_must_exist(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})


def test_cores_are_split_by_what_the_gpu_worker_computes_on() -> None:
    assert split_cores({0, 1, 2, 3}, cuda=True) == ([1, 2, 3], [0])
    assert split_cores({0, 1, 2, 3, 4}, cuda=False) == ([2, 3, 4], [0, 1])
    assert split_cores({5}, cuda=False) == ([5], [5])
    with pytest.raises(CoreError, match="not among the cores"):
        check_cores("cpu_worker", [7], None, owned={0, 1})
    with pytest.raises(CoreError, match="threads = 3 exceeds its 2 cores"):
        check_cores("cpu_worker", [0, 1], 3, owned={0, 1})


def test_the_daemon_keeps_off_a_cpu_drafters_cores_only() -> None:
    assert daemon_cores({0, 1}, [1], cuda=False) == {0}  # the verifier's core
    assert daemon_cores({0, 1, 2, 3, 4}, [2, 3], cuda=False) == {0, 1, 4}
    assert daemon_cores({5}, [5], cuda=False) is None  # one core: nowhere else to go
    assert daemon_cores({0, 1, 2, 3}, [1, 2, 3], cuda=True) is None  # the GPU worker's core


@pytest.mark.skipif(len(owned_cores()) < 2, reason="needs two cores to split")
def test_the_verifier_borrows_the_drafters_cores_only_where_both_compute_on_the_cpu() -> None:
    def spare(**environ: str) -> dict[str, tuple[int, ...]]:
        specs = worker_specs(load_config(environ=environ), "json", gpu_runtime="torch")
        return {name: spec.spare_cores for name, spec in specs.items()}

    cpu_cores, gpu_cores = split_cores(owned_cores(), cuda=False)
    on_cpu = {"HETSPEC_GPU_WORKER__DEVICE": "cpu"}
    # draft-cpu: the GPU worker verifies; draft-gpu: the CPU worker does
    assert spare(**on_cpu) == {"cpu": (), "gpu": tuple(cpu_cores)}
    assert spare(**on_cpu, HETSPEC_PLACEMENT="draft-gpu") == {"cpu": tuple(gpu_cores), "gpu": ()}
    assert spare(**on_cpu, HETSPEC_LEND_CORES="false") == {"cpu": (), "gpu": ()}
    # with CUDA the verifier's work is on the GPU: nothing to lend
    assert spare(HETSPEC_GPU_WORKER__DEVICE="cuda") == {"cpu": (), "gpu": ()}


async def test_arena_slots_are_lent_to_one_owner_at_a_time() -> None:
    pool = SlotPool(2)
    first = pool.lend("request 1")
    async with pool.lease("request 2") as second:
        assert second != first
        with pytest.raises(SlotError, match=r"no free arena slot for request 3 \(held: "):
            pool.lend("request 3")
    assert pool.free == 1
    pool.give_back(first)
    assert pool.free == 2
    with pytest.raises(SlotError, match="was not lent"):
        pool.give_back(first)


async def test_a_slot_given_back_not_before_a_future_waits_for_it() -> None:
    """A lease waits for a settling slot rather than failing; the slot is lent once the
    future is done, whatever its outcome."""
    pool = SlotPool(1)
    worker_done = asyncio.get_running_loop().create_future()
    async with pool.lease("request 1", lambda: worker_done):
        pass
    assert pool.free == 0
    with pytest.raises(SlotError, match=r"settling: \[0\]"):
        pool.lend("request 2")
    lent = asyncio.Event()

    async def request_two() -> None:
        async with pool.lease("request 2"):
            lent.set()

    second = asyncio.ensure_future(request_two())
    await asyncio.sleep(0.01)
    assert not lent.is_set()
    worker_done.set_exception(RuntimeError("the worker died"))
    await asyncio.wait_for(second, 1)
    assert lent.is_set()
    assert pool.free == 1


def test_llama_cpp_settings_follow_the_workers_role_unless_configured() -> None:
    """A verifier: no flash attention, f16 K and f32 V caches (its logits stay closest to one
    token at a time); a drafter: llama.cpp's "auto" and f16; a configured type is kept."""

    def cpu_settings(**environ: str):
        return worker_specs(load_config(environ=environ), "json", gpu_runtime="torch")[
            "cpu"
        ].settings

    drafter = cpu_settings()  # the default placement, draft-cpu: llama.cpp drafts
    assert (drafter.flash_attention, drafter.kv_type, drafter.v_type) == ("auto", "f16", None)
    verifier = cpu_settings(HETSPEC_PLACEMENT="draft-gpu")
    assert (verifier.flash_attention, verifier.kv_type, verifier.v_type) == ("off", "f16", "f32")
    chosen = cpu_settings(HETSPEC_PLACEMENT="draft-gpu", HETSPEC_CPU_WORKER__KV_TYPE="f32")
    assert (chosen.kv_type, chosen.v_type) == ("f32", None)


def test_a_matmul_tiling_reaches_the_gpu_workers_settings() -> None:
    """``--set gpu_worker.matmul_tiling={block_n=32,warps=8}`` (a TOML inline table): the
    fields given, the others left to the kernel's default; a typo names the key."""
    tiling = parse_value("{block_n=32,warps=8}")
    overrides = {"gpu_worker.matmul": "triton", "gpu_worker.matmul_tiling": tiling}
    config = load_config(environ={}, overrides=overrides)
    settings = worker_specs(config, "json", gpu_runtime="torch")["gpu"].settings
    assert settings.matmul == "triton"
    assert settings.matmul_tiling == MatmulTiling(block_n=32, warps=8)
    with pytest.raises(ConfigError, match=r"gpu_worker\.matmul_tiling\.block_m: unknown setting"):
        load_config(environ={}, overrides={"gpu_worker.matmul_tiling": {"block_m": 32}})


def test_a_native_kernel_level_cap_reaches_both_native_workers() -> None:
    """``--set native_kernels="avx2"`` caps the native kernels of the drafter and the verifier
    alike ("best": no cap); a level no CPU family has is refused by name."""
    config = load_config(environ={}, overrides={"native_kernels": "avx2"})
    specs = worker_specs(config, "json", gpu_runtime="native", drafter_runtime="native")
    assert specs["gpu"].settings.simd == specs["cpu"].settings.simd == "avx2"
    best = worker_specs(
        load_config(environ={}), "json", gpu_runtime="native", drafter_runtime="native"
    )
    assert best["gpu"].settings.simd is best["cpu"].settings.simd is None
    with pytest.raises(ConfigError, match="native_kernels"):
        load_config(environ={}, overrides={"native_kernels": "avx512"})
