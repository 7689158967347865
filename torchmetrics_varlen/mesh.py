"""The process group to sync metrics over in a multi-dimensional parallel job (a ``DeviceMesh``)."""

import math
from collections.abc import Sequence
from typing import Any

from torchmetrics_varlen import _engine

__all__ = ["mesh_group"]


def mesh_group(mesh: Any, dims: str | Sequence[str]) -> Any:
    """Return the process group that joins this rank with the ranks of the same mesh slice along ``dims``.

    Pass it as ``process_group=`` to a metric. Name the dimensions whose ranks hold *different* samples (or tokens)
    and leave out those whose ranks hold copies of the same ones, so that each sample is counted once: ``"dp"`` with
    tensor parallelism (mesh ``("dp", "tp")``), ``("replicate", "shard")`` for HSDP, ``("dp", "cp")`` for token-level
    states under context parallelism (the "Frameworks" docs page has the table).

    One dimension gives the mesh's own group (``mesh.get_group(dim)``). Several dimensions give a group of their
    own, made on the first call for that mesh and those dimensions: that first call is a collective of the whole
    world (every rank must make it, in the same order), later ones return the same group at no cost.

    Args:
        mesh: a :class:`torch.distributed.device_mesh.DeviceMesh` with ``mesh_dim_names``.
        dims: the name of one mesh dimension, or several names.

    Returns:
        The process group of this rank's slice along ``dims``.

    Raises:
        ValueError: ``mesh`` has no dimension names, a name is not one of them, or a name is repeated.

    Example:
        Without a process group only the argument checks run; see the "Frameworks" docs page for a job on a mesh:

        >>> from torchmetrics_varlen import mesh_group
        >>> mesh_group(object(), "dp")
        Traceback (most recent call last):
        ...
        ValueError: Expected `mesh` to be a DeviceMesh with `mesh_dim_names` but got object
    """
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or not hasattr(mesh, "get_group"):
        raise ValueError(f"Expected `mesh` to be a DeviceMesh with `mesh_dim_names` but got {type(mesh).__name__}")
    wanted = (dims,) if isinstance(dims, str) else tuple(dims)
    if not wanted or any(name not in names for name in wanted) or len(set(wanted)) != len(wanted):
        raise ValueError(
            f"Expected `dims` to be distinct names among the mesh's dimensions {tuple(names)} but got {dims!r}"
        )
    if len(wanted) == 1:
        return mesh.get_group(wanted[0])
    # Ranks of every slice along `wanted`: the other dimensions first, the wanted ones last, flattened into rows.
    axes = [i for i, name in enumerate(names) if name not in wanted] + [names.index(name) for name in wanted]
    size = math.prod(mesh.mesh.shape[names.index(name)] for name in wanted)
    return _engine.flattened_group(mesh, wanted, lambda: mesh.mesh.permute(axes).reshape(-1, size).tolist())
