"""Compute devices: listing, choosing the drafter's device, and the device code path itself.

On a GPU build the tests below also run on each local GPU (`LOCAL_DEVICES`). CI has no GPU,
but it does have ggml's RPC backend: the shipped `ggml-rpc-server` (upstream's
tool, CPU backend) serves a device whose buffers live in another process, exactly as a GPU's
live in device memory. A drafter on that device must load its weights and cache there, keep the
selector codebooks and the exact head on the host, let the scheduler move activations between
the two, and still match the float64 torch reference and keep speculative decoding lossless.
Any host access to device memory (reading `tensor->data` of a device tensor) fails here.

RPC work runs in a child process (`rpc_worker.py`): registered RPC devices would otherwise join
every later target context of the test session.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import pydflash
from pydflash import Drafter, Engine
from pydflash.runtime import devices
from pydflash.tools.upstream_binaries import tool_path
from pydflash.tools.upstream_server import free_port
from pydflash.cli import main as cli_main

from test_drafter_native import BLOCK, VOCAB, _build, nmse, random_context, reference_block
from test_speculative_loop import _tie_aware_equal

WORKER = Path(__file__).with_name("rpc_worker.py")


# --- listing and choosing -------------------------------------------------------------------


def test_the_cpu_is_always_listed():
    found = devices.devices()
    cpu = [d for d in found if d.kind == "cpu"]
    assert len(cpu) == 1 and cpu[0].name == "CPU"
    assert all(d.name and isinstance(d.memory_total, int) for d in found)


def test_auto_device_follows_the_target():
    gpus = [d.name for d in devices.devices() if d.kind in ("gpu", "igpu")]
    assert devices.resolve_drafter_device("auto", 0) == "CPU"
    assert devices.resolve_drafter_device("auto", -1) == (gpus[0] if gpus else "CPU")
    assert devices.resolve_drafter_device(None, -1) == "CPU"
    assert devices.resolve_drafter_device("cpu", 0) == "CPU"
    assert devices.resolve_drafter_device("CUDA3", 0) == "CUDA3"


def test_unknown_device_is_a_clear_error(dflash2, smollm2_path):
    gguf, _ = dflash2
    with pytest.raises(pydflash.InvalidArgumentError, match=r"no device named 'CUDA7'.*devices: .*CPU"):
        Drafter(gguf, smollm2_path, n_ctx=64, n_threads=1, device="CUDA7")
    with pytest.raises(pydflash.InvalidArgumentError, match="device must be"):
        Drafter(gguf, smollm2_path, n_ctx=64, n_threads=1, device="")
    with pytest.raises(pydflash.InvalidArgumentError, match="no device named 'nope'"):
        Engine(smollm2_path, gguf, n_ctx=64, n_threads=1, drafter_device="nope")
    with Drafter(gguf, smollm2_path, n_ctx=64, n_threads=1, device="cpu") as d:  # names are case-blind
        assert d.info.device == "CPU"


def test_clis_with_an_unknown_draft_device(dflash2, smollm2_path, capsys, tmp_path):
    """generate, profile and bench take llama.cpp's -ngl / -devd / --rpc and report bad ones."""
    argv = ["generate", "-m", str(smollm2_path), "-md", str(dflash2[0]), "-p", "x", "-n", "1", "-t", "1",
            "-devd", "CUDA7"]
    assert cli_main(argv) == 1
    assert "no device named 'CUDA7'" in capsys.readouterr().err
    assert cli_main(argv[:-2] + ["--rpc", "nowhere"]) == 1
    assert "host:port" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def f():"}\n')
    common = ["-m", str(smollm2_path), "-md", str(dflash2[0]), "--prompts", str(prompts), "-t", "1", "-n", "2",
              "-devd", "CUDA7", "-o", str(tmp_path / "out")]
    for command in (["profile"], ["bench", "--no-upstream", "--no-auto"]):
        assert cli_main(command + common) == 1
        assert "no device named 'CUDA7'" in capsys.readouterr().err


def test_devices_cli_lists_the_cpu(capsys):
    assert cli_main(["devices"]) == 0
    assert any(line.split()[:2] == ["CPU", "cpu"] for line in capsys.readouterr().out.splitlines())


# --- every device of this build (the CPU here; CUDA/Metal devices too on GPU builds) ----------

# RPC devices never appear here: they are only ever added in child processes (see below).
LOCAL_DEVICES = [d.name for d in devices.devices() if d.kind in ("cpu", "gpu", "igpu")]


@pytest.mark.parametrize("device", LOCAL_DEVICES)
def test_drafter_on_each_local_device_matches_the_reference(device, dflash2, smollm2_path, smol_target):
    gguf, ref = dflash2
    feats = random_context(48, seed=9)
    # ggml-cuda rounds inside its matmul and attention paths: 3.5e-6 measured on an H200
    # (benchmarks/results/gpu-h200-s9), where the CPU stays far under 1e-6.
    bound = 1e-6 if device == "CPU" else 1e-5
    for exact_head in (True, False):
        with Drafter(gguf, smollm2_path, n_ctx=128, n_threads=1, exact_head=exact_head, device=device) as d:
            assert d.info.device == device
            for n_ctx, anchor in ((47, 321), (5, 40000)):
                d.crop(0)
                d.inject(feats[:n_ctx], np.arange(n_ctx))
                hidden, logits = d.forward(anchor, n_ctx, BLOCK)
                proposal = d.propose(anchor, n_ctx, BLOCK, temperature=0.0)
                ref_hidden, ref_logits = reference_block(ref, feats[:n_ctx], np.arange(n_ctx), anchor, n_ctx,
                                                         smol_target)
                assert nmse(hidden, ref_hidden.numpy()) <= bound
                assert nmse(logits, ref_logits.numpy()) <= (bound if exact_head else 1e-4)
                if exact_head:
                    want = ref.propose(ref_hidden, ref_logits, anchor)
                    np.testing.assert_array_equal(proposal.tokens, want.tokens.numpy())


@pytest.mark.parametrize("device", LOCAL_DEVICES)
def test_speculative_decoding_on_each_local_device_is_lossless(device, smollm2_path, smollm2):
    """Target and drafter where a user would put them on this device (all layers offloaded to a GPU)."""
    n_gpu_layers = 0 if device == "CPU" else -1
    with Engine(smollm2_path, "auto", n_ctx=512, n_threads=1, n_gpu_layers=n_gpu_layers, n_max=3,
                drafter_device=device) as engine:
        assert engine.drafter is not None and engine.drafter.info.device == device
        for prompt in ("def add(a, b):", "The three laws of robotics are"):
            tokens = smollm2.tokenize(prompt)
            plain = smollm2.generate(tokens, max_tokens=24, temperature=0, ignore_eos=True).tokens
            spec = engine.generate(tokens, max_tokens=24, temperature=0, ignore_eos=True)
            assert spec.stats.n_drafted > 0
            _tie_aware_equal(smollm2, tokens, plain, spec.tokens)


# --- RPC endpoints that are not there must not take the process down -------------------------


def test_bad_rpc_endpoints_raise_and_the_process_survives():
    with pytest.raises(pydflash.InvalidArgumentError, match="host:port"):
        devices.add_rpc_server("localhost")
    with pytest.raises(pydflash.InvalidArgumentError, match="host:port"):
        devices.add_rpc_server("localhost:http")
    with pytest.raises(pydflash.BackendError, match="no ggml RPC server answers"):
        devices.add_rpc_server(f"127.0.0.1:{free_port()}")  # nobody listens

    # something listens but speaks another protocol: it answers with garbage and hangs up
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises(pydflash.BackendError, match="no ggml RPC server answers"):
            devices.add_rpc_server(f"127.0.0.1:{port}")
    finally:
        listener.close()
    assert [d.name for d in devices.devices() if d.kind == "cpu"] == ["CPU"]  # still here, nothing added


# --- the device code path, on an RPC device --------------------------------------------------


@pytest.fixture(scope="module")
def rpc_endpoint():
    port = free_port()
    proc = subprocess.Popen([str(tool_path("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"ggml-rpc-server did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


def run_worker(endpoint: str, job: dict, tmp: Path) -> dict[str, np.ndarray]:
    job_path, out_path = tmp / "job.json", tmp / "out.npz"
    job_path.write_text(json.dumps(job))
    run = subprocess.run([sys.executable, str(WORKER), endpoint, str(job_path), str(out_path)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"worker failed ({run.returncode}):\n{run.stderr[-4000:]}"
    with np.load(out_path) as out:
        return dict(out)


@pytest.fixture(scope="module")
def dflash2(tmp_path_factory, smollm2_path):
    return _build(tmp_path_factory.mktemp("dflash2-devices"), "dflash2", smollm2_path)


@pytest.fixture(scope="module")
def smol_target(smollm2_path):
    from pydflash.reference import TargetWeights

    return TargetWeights.from_gguf(smollm2_path, dtype=torch.float64)


def test_devices_cli_adds_an_rpc_server(rpc_endpoint):
    run = subprocess.run([sys.executable, "-m", "pydflash.cli", "devices", "--rpc", rpc_endpoint],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()]
    assert any(r[:2] == ["RPC0", "gpu"] and r[-1] == rpc_endpoint for r in rows), run.stdout
    assert any(r[:2] == ["CPU", "cpu"] for r in rows)


@pytest.mark.parametrize("exact_head", [True, False])
def test_drafter_on_an_rpc_device_matches_the_reference(exact_head, rpc_endpoint, dflash2, smollm2_path,
                                                        smol_target, tmp_path):
    """Weights and cache in the device's memory; exact head (a CPU op reading the mapped head) or
    the head copied to the device. Same numbers as the reference, and as the CPU drafter."""
    gguf, ref = dflash2
    feats = random_context(64, seed=5)
    np.save(tmp_path / "feats.npy", feats)
    rng = np.random.default_rng(7)
    blocks = [(int(rng.integers(1, 64)), int(rng.integers(0, VOCAB))) for _ in range(4)]
    job = dict(kind="drafter", drafter=str(gguf), target=str(smollm2_path), features=str(tmp_path / "feats.npy"),
               blocks=blocks, n_block=BLOCK, exact_head=exact_head)
    got = run_worker(rpc_endpoint, job, tmp_path)
    assert str(got["device"]) == "RPC0"

    with Drafter(gguf, smollm2_path, n_ctx=256, n_threads=1, exact_head=exact_head) as cpu:
        for i, (n_ctx, anchor) in enumerate(blocks):
            ref_hidden, ref_logits = reference_block(ref, feats[:n_ctx], np.arange(n_ctx), anchor, n_ctx, smol_target)
            assert nmse(got[f"hidden{i}"], ref_hidden.numpy()) <= 1e-6
            # the default head rounds activations to 8 bits inside the mat-mul (on any device)
            assert nmse(got[f"logits{i}"], ref_logits.numpy()) <= (1e-6 if exact_head else 1e-4)
            if exact_head:
                want = ref.propose(ref_hidden, ref_logits, anchor)
                np.testing.assert_array_equal(got[f"tokens{i}"], want.tokens.numpy(), err_msg=f"block {i}")
            cpu.crop(0)
            cpu.inject(feats[:n_ctx], np.arange(n_ctx))
            hidden, logits = cpu.forward(anchor, n_ctx, BLOCK)
            assert nmse(got[f"hidden{i}"], hidden) <= 1e-10  # the same CPU kernels, wherever they ran
            assert nmse(got[f"logits{i}"], logits) <= 1e-10


@pytest.mark.parametrize("n_gpu_layers", [0, -1])
def test_speculative_decoding_on_an_rpc_device_is_lossless(n_gpu_layers, rpc_endpoint, smollm2_path, smollm2,
                                                           tmp_path):
    """The shipped drafter on the device, the target on the CPU (0) or offloaded to the same
    device (-1, the drafter following it with drafter_device="auto"): greedy output = plain."""
    from pydflash import drafters

    prompts = ["def add(a, b):", "The three laws of robotics are"]
    job = dict(kind="engine", target=str(smollm2_path), drafter=str(drafters.resolve_auto(smollm2)),
               n_gpu_layers=n_gpu_layers, drafter_device="rpc" if n_gpu_layers == 0 else "auto",
               prompts=prompts, max_tokens=24, n_max=3)
    got = run_worker(rpc_endpoint, job, tmp_path)
    assert str(got["device"]) == "RPC0"
    for i, prompt in enumerate(prompts):
        tokens = smollm2.tokenize(prompt)
        plain_cpu = smollm2.generate(tokens, max_tokens=24, temperature=0, ignore_eos=True).tokens
        assert int(got[f"drafted{i}"]) > 0
        _tie_aware_equal(smollm2, tokens, list(got[f"plain{i}"]), list(got[f"spec{i}"]))
        _tie_aware_equal(smollm2, tokens, plain_cpu, list(got[f"spec{i}"]))
