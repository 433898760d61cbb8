"""ckptio.distributed on 4 spawned gloo ranks against moto behind a counting proxy.

One group runs every scenario (spawning ranks is the slow part): one node (each object fetched
once), two simulated nodes (twice), network broadcast (once), a DCP checkpoint (each file once),
a missing object (every rank raises), and a stuck downloading rank (the others time out).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import cache_workers as W
import ckptio
import ckptio.dcp as cd
from conftest import S3_TEST_OPTIONS
from multiproc import run_ranks

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.timeout(150)]
WORLD = 4


def gets(proxy, key: str) -> int:
    """GET requests whose object path ends with ``key`` (ranged or whole)."""
    return sum(1 for r in proxy.requests if r.method == "GET" and r.path.split("?")[0].endswith("/" + key))


@pytest.fixture(scope="module")
def outcome(tmp_path_factory, s3_endpoint):
    """Run the scenarios once; yield (per-rank results, GET counts per key, objects' sizes)."""
    from conftest import _s3_bucket
    from servers import CountingProxy

    ckptio.reset()
    tmp = str(tmp_path_factory.mktemp("dist"))
    with CountingProxy(s3_endpoint) as proxy:
        root = _s3_bucket(s3_endpoint, proxy.url)
        tensors = {"a.pt": torch.arange(40.0), "b.pt": torch.arange(50.0), "c.pt": torch.arange(3000.0)}
        for name, t in tensors.items():
            ckptio.dump({"w": t}, f"{root}/{name}")
        cd.save({"w": torch.arange(32.0).reshape(8, 4), "b": torch.arange(16)}, f"{root}/dcp")
        dcp_files = [u.rsplit("/", 1)[1] for u in ckptio.ls(f"{root}/dcp")]
        sizes = {k: ckptio.stat(f"{root}/{k}").size for k in tensors}
        proxy.clear()
        backends = {"s3": {"endpoint_url": proxy.url, **S3_TEST_OPTIONS}}
        run_ranks(W.dist_main, WORLD, backends, root, tmp)
        results = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(WORLD)]
        counts = {k: gets(proxy, k) for k in [*tensors, *dcp_files, "missing.pt"]}
        bytes_out = {
            k: sum(r.bytes_out for r in proxy.requests if r.method == "GET" and r.path.split("?")[0].endswith("/" + k))
            for k in tensors
        }
    ckptio.reset()
    yield {"results": results, "counts": counts, "sizes": sizes, "bytes_out": bytes_out, "dcp_files": dcp_files}


def test_four_ranks_one_node_fetch_each_object_once(outcome):
    for r in outcome["results"]:
        assert r["one_node"] == ["ok", list(range(40))], r["one_node"]
    # a.pt is loaded again in the 'stuck' scenario, by rank 0 only and from its (hot) cache
    assert outcome["counts"]["a.pt"] == 1
    assert outcome["bytes_out"]["a.pt"] == outcome["sizes"]["a.pt"]


def test_two_simulated_nodes_fetch_twice(outcome):
    for r in outcome["results"]:
        assert r["two_nodes"] == ["ok", list(range(50))], r["two_nodes"]
    assert outcome["counts"]["b.pt"] == 2
    assert outcome["bytes_out"]["b.pt"] == 2 * outcome["sizes"]["b.pt"]


def test_network_mode_reads_once_and_broadcasts_in_chunks(outcome):
    for r in outcome["results"]:
        assert r["network"] == ["ok", [float(x) for x in range(3000)]]
    assert outcome["bytes_out"]["c.pt"] == outcome["sizes"]["c.pt"]  # several chunks, each byte once


def test_dcp_checkpoint_files_fetched_once_per_node(outcome):
    for r in outcome["results"]:
        assert r["dcp"] == ["ok", [float(sum(range(32))), list(range(16))]], r["dcp"]
    assert outcome["dcp_files"] and all(outcome["counts"][f] == 1 for f in outcome["dcp_files"]), outcome["counts"]


@pytest.mark.parametrize("scenario", ["missing", "missing_network"])
def test_failure_on_the_downloading_rank_reaches_every_rank(outcome, scenario):
    first, *others = [r[scenario] for r in outcome["results"]]
    assert first[:2] == ["error", "NotFoundError"] and "missing.pt" in first[2]
    for o in others:
        assert o[:2] == ["error", "RankFailedError"], o
        assert "rank 0" in o[2] and "missing.pt" in o[2] and "NotFoundError" in o[2]


def test_stuck_downloading_rank_makes_the_others_time_out(outcome):
    for r in outcome["results"][1:]:
        assert r["stuck"][:2] == ["error", "DistributedTimeoutError"], r["stuck"]
        assert "1.5s" in r["stuck"][2] and "node leaders" in r["stuck"][2]
        assert r["stuck_seconds"] < 1.5 + 10  # gave up at the timeout rather than waiting for rank 0
    assert outcome["results"][0]["stuck"][0] == "error"  # rank 0 then finds nobody left to talk to
