import dist as D

from ucp_dcp.testing.memory_jobs import lose_hosts, resume_job, save_job, simulate_hosts


def _save(rank, world, root, durable, topo, fault):
    simulate_hosts(2)
    out = save_job(topo, root, durable, fault=fault)
    if rank == 0:
        lose_hosts(root, ["node1"])
    return out


def _load(rank, world, root, durable, topo, oracle):
    simulate_hosts(2)
    return resume_job(topo, root, durable, oracle)


def test_scratch():
    root, durable = D.tmpdir(), D.tmpdir()
    saved = D.run(_save, 4, root, durable, "dp=2,tp=2", None)[0]
    print(saved["statuses"], saved["blocked"])
    got = D.run(_load, 2, root, durable, "tp=2", saved["oracles"][-1])[0]
    print(got)
    assert got["diffs"] == [] and got["tier"] == "memory"
