"""torch.distributed setup from Slurm's / torchrun's environment: the parsing, on CPU."""

from __future__ import annotations

import pytest

from fp8rl.job.distributed import (
    SINGLE_PROCESS,
    DistEnv,
    cuda_device_index,
    dist_env_from_environ,
    expand_hostlist,
    init_distributed,
    parse_tasks_per_node,
    slurm_dist_env,
)

pytestmark = pytest.mark.timeout(60)


def slurm_task(procid: int, localid: int, nodeid: int, **extra: str) -> dict[str, str]:
    """The variables srun sets for one task of a 2-node x 4-GPU job."""
    return {
        "SLURM_JOB_ID": "4711",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_NTASKS": "8",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
        "SLURM_STEP_ID": "0",
        **extra,
    }


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[001-003,007]", ["gpu001", "gpu002", "gpu003", "gpu007"]),
        ("a[1-2],b3,c[09-11]", ["a1", "a2", "b3", "c09", "c10", "c11"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("vm", ["vm"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


def test_tasks_per_node() -> None:
    assert parse_tasks_per_node("8(x2),4") == [8, 8, 4]
    assert parse_tasks_per_node("2,1") == [2, 1]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node("eight")


def test_every_task_of_a_two_node_job_gets_a_distinct_rank_and_the_same_rendezvous() -> None:
    envs = [slurm_dist_env(slurm_task(rank, rank % 4, rank // 4)) for rank in range(8)]
    assert [e.rank for e in envs] == list(range(8))
    assert {e.world_size for e in envs} == {8}
    assert [e.local_rank for e in envs] == [0, 1, 2, 3] * 2
    assert [e.node_rank for e in envs] == [0] * 4 + [1] * 4
    assert {(e.master_addr, e.master_port) for e in envs} == {("gpu007", 29500 + 4711)}
    assert {e.local_world_size for e in envs} == {4}
    assert {e.num_nodes for e in envs} == {2}
    assert envs[5].torch_env() == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu007",
        "MASTER_PORT": str(29500 + 4711),
    }


def test_explicit_master_and_array_job_ids() -> None:
    env = slurm_dist_env(slurm_task(0, 0, 0, MASTER_ADDR="10.0.0.1", MASTER_PORT="1234"))
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)
    array_task = slurm_dist_env(slurm_task(0, 0, 0, SLURM_JOB_ID="123_4"))
    assert array_task.master_port == 29500 + 1234


def test_rank_outside_world_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        slurm_dist_env(slurm_task(8, 0, 0))


def test_source_precedence() -> None:
    assert dist_env_from_environ({}) == SINGLE_PROCESS
    # An sbatch script outside srun carries SLURM_PROCID but no step: one process.
    batch_script = {k: v for k, v in slurm_task(0, 0, 0).items() if k != "SLURM_STEP_ID"}
    assert dist_env_from_environ(batch_script) == SINGLE_PROCESS
    assert dist_env_from_environ(slurm_task(3, 3, 0)).source == "slurm"
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "5"}
    env = dist_env_from_environ({**slurm_task(3, 3, 0), **torchrun})
    assert (env.source, env.rank, env.world_size, env.master_addr) == ("torchrun", 1, 2, "h")


def test_gpu_choice() -> None:
    env = DistEnv(5, 8, 1, 4, 1, 2, "h", 1, "slurm")
    assert cuda_device_index(env, 4) == 1  # the task sees the whole node
    assert cuda_device_index(env, 1) == 0  # --gpus-per-task=1
    with pytest.raises(RuntimeError, match="local rank"):
        cuda_device_index(DistEnv(5, 8, 5, 8, 0, 1, "h", 1, "slurm"), 4)


def test_single_process_init_is_a_no_op(monkeypatch) -> None:
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a single process must not create a process group")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    # (not `dist.is_initialized()`: the trainer's tests create megatron's one-process group in this process)
    init_distributed(SINGLE_PROCESS)


def _rank_main(rank: int, port: int, queue) -> None:  # noqa: ANN001 - multiprocessing queue
    import torch
    import torch.distributed as dist

    from fp8rl.job.distributed import shutdown_distributed

    environ = slurm_task(
        rank,
        rank,
        0,
        SLURM_NTASKS="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_NUM_NODES="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    init_distributed(slurm_dist_env(environ), backend="gloo", timeout_s=60)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    queue.put((rank, dist.get_world_size(), value.item()))
    shutdown_distributed()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_slurm_tasks_form_a_gloo_group_on_cpu() -> None:
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")  # fork would copy the threads (OpenMP, tracking) earlier tests started
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=150) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == [(0, 2, 3.0), (1, 2, 3.0)]
