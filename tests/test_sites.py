"""The two-level plan across sites (plan/sites.py): each byte crosses once per site, then is
forwarded inside it, and every reader ends bitwise equal (run in numpy, no transport)."""

from __future__ import annotations

import json

import pytest

from weightsync.cli import main
from weightsync.configs import load_spec
from weightsync.layout import parse_layout
from weightsync.plan.reference import check_destinations, cut_shards, empty_shards, random_canonical, run_plan
from weightsync.plan.sites import Sites, plan_sites

SPEC = load_spec("tiny-qwen3-moe")


def layouts(text: str, count: int = 1) -> list:
    """``count`` copies of every rank of a layout, numbered in order."""
    kind = parse_layout(text)
    ranks = [kind.rank_layout(SPEC, i) for i in range(kind.world_size)] * count
    return [layout.with_rank(i) for i, layout in enumerate(ranks)]


def nbytes(layout) -> int:
    from weightsync.layout.types import itemsize

    return sum(region.numel * itemsize(shard.dtype) for shard, region in layout.regions())


@pytest.mark.parametrize(("target", "copies", "reader_sites"), [
    pytest.param("vllm:tp=1", 8, "b*4,c*4", id="replicas-of-tp1"),
    pytest.param("vllm:tp=2", 4, "b*4,c*4", id="replicas-of-tp2"),
    pytest.param("vllm:tp=2", 3, "a*2,b*2,c*2", id="a-site-with-the-writers"),
    pytest.param("vllm:tp=2,dp=2,ep=4", 2, "b*4,c*4", id="experts"),
])
def test_each_byte_crosses_once_per_site_and_every_reader_is_bitwise(target, copies, reader_sites):
    writers = layouts("megatron:tp=2,ep=2,etp=1")
    readers = layouts(target, copies)
    sites = Sites.parse("a", reader_sites, num_writers=len(writers), num_readers=len(readers))
    split = plan_sites(writers, readers, sites)
    values = random_canonical(writers[0].canonical, seed=1)
    src = {w.rank: cut_shards(w, values) for w in writers}
    dst = {r.rank: empty_shards(r) for r in readers}
    writes = run_plan(split.across_plan(writers), src, dst)
    for site in sites.reader_sites():
        inside = split.inside_plan(site)
        if inside is not None:
            more = run_plan(inside, {r: dst[r] for r in split.site_readers(site)}, dst)
            for r, shards in more.items():
                for name, count in shards.items():
                    writes[r][name] = writes[r].get(name, 0) + count
    check_destinations(readers, dst, values)
    for r in readers:  # every element written exactly once, over both levels
        for shard in r.shards:
            assert int(writes[r.rank][shard.name].max(initial=0)) <= 1
    report = split.report(writers, inside_gbps=400, across_gbps=10)
    one_copy = dict.fromkeys(sites.reader_sites(), 0)
    for site in one_copy:  # one copy of what the site's readers hold, together
        one_copy[site] = sum(nbytes(split.first[r]) for r in split.site_readers(site))
    remote = [s for s in sites.reader_sites() if sites.remote(s)]
    assert report["across_bytes"] == sum(one_copy[s] for s in remote)
    assert report["flat_across_bytes"] == sum(nbytes(readers[r]) for s in remote for r in split.site_readers(s))
    assert report["across_bytes"] <= report["flat_across_bytes"]
    if report["across_bytes"] < report["flat_across_bytes"]:  # some site holds a byte twice: forwarded inside
        assert report["seconds"] < report["flat_seconds"]


def test_sites_name_every_rank_or_say_how_many_they_name():
    assert Sites.parse("a", "b*2,c", num_writers=2, num_readers=3).readers == ("b", "b", "c")
    with pytest.raises(ValueError, match=r"reader sites 'b\*2' name 2 rank\(s\), the job has 3"):
        Sites.parse("a", "b*2", num_writers=1, num_readers=3)
    with pytest.raises(ValueError, match="every writer rank needs a site"):
        Sites(writers=("",), readers=("b",))


def test_plan_command_reports_bytes_per_link_class(capsys):
    assert main(["plan", "--config", "tiny-qwen3", "--source", "fsdp:dp=2", "--target", "vllm:tp=2,replicas=4",
                 "--writer-sites", "a", "--reader-sites", "b*4,c*4", "--link-gbps", "400", "--across-gbps", "10",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sites, total = out["sites"], out["total_bytes"]
    assert sites["across_bytes"] == 2 * total  # one copy per site
    assert sites["flat_across_bytes"] == out["needed_bytes"]  # flat: every reader's bytes from the writers
    assert sites["inside_bytes"] == out["needed_bytes"] - 2 * total and sites["flat_inside_bytes"] == 0
    assert sites["seconds"] < sites["flat_seconds"]
