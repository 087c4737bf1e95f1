"""The root mesh's rank -> coordinate index behind ``MeshInfo.position`` (``ucp_dcp.layout.placements``):
equal to a scan of the grid for every rank, for any shape and any rank order (meshes built from a permuted
rank list, as torchtitan's and DeviceMesh's own reorderings give)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_dcp.layout.placements import _rank_coordinates


@settings(max_examples=60)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_index_equals_a_scan_of_the_grid(shape, rnd):
    ranks = list(range(int(torch.Size(shape).numel())))
    rnd.shuffle(ranks)
    root = _Mesh(torch.tensor(ranks).reshape(shape))
    index = _rank_coordinates(root)
    assert index == {r: tuple(int(c) for c in (root.mesh == r).nonzero()[0].tolist()) for r in ranks}
    assert _rank_coordinates(root) is index  # built once per root mesh
    assert not vars(root).keys() - {"mesh"}  # kept beside the mesh, not on it (a mesh is pickled with DTensors)


class _Mesh:
    """A root mesh as the index reads it (its rank grid), weakly referenceable like DeviceMesh."""

    def __init__(self, mesh):
        self.mesh = mesh
