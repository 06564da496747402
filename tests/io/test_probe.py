"""A fill's page-cache probe is made once: `warm_fills` (mincore, before the reads start) hands its answer to the
reads, which then skip their own probe; a bundle it found cold is probed and counted cold (real files, real page
cache: evicted with posix_fadvise)."""

import os
import shutil

from edge0.compute.executors import warm_fills
from edge0.io.pagecache import Residency, evict
from edge0.io.reader import BundleReader
from edge0.model.demo import DEMO_STORE


def test_a_fill_found_in_the_page_cache_is_not_probed_again_and_a_cold_one_is_counted(tmp_path, monkeypatch):
    store = tmp_path / "store"
    shutil.copytree(DEMO_STORE, store)
    probes = []
    cached_fraction = Residency.cached_fraction
    monkeypatch.setattr(Residency, "cached_fraction", lambda self, *a: probes.append(a) or cached_fraction(self, *a))
    reader = BundleReader(store)
    try:
        m = reader.manifest
        layer = m.layers[0].layer
        buffers = lambda: [memoryview(bytearray(p.nbytes)) for p in m.pieces]  # noqa: E731
        reader.read_into(layer, 3, buffers())  # now in the page cache
        probes.clear()
        cached = warm_fills(reader, layer, [(0, 3)], m.num_experts)
        assert cached == [True] and len(probes) == 1
        cold = reader.stats.cold_bytes
        reader.pool.read_bundles(layer, [(3, buffers())], cached=cached)
        assert len(probes) == 1 and reader.stats.cold_bytes == cold  # no second probe; counted warm

        os.sync()  # the copy's pages written back: only clean pages can be dropped
        evict(reader.path(layer))
        probes.clear()
        cached = warm_fills(reader, layer, [(0, 5)], m.num_experts)
        assert cached == [False]
        reader.pool.read_bundles(layer, [(5, buffers())], cached=cached)
        assert len(probes) == 2 and reader.stats.cold_bytes - cold == m.bundle_bytes  # probed by the read: cold
    finally:
        reader.close()
