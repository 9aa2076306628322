"""SmartRedis' ``DatasetConverter``: a Dataset laid out so that it turns into xarray ``DataArray`` objects.

``add_metadata_for_xarray`` records, in metadata fields of the dataset, which tensors are data
variables and which metadata fields hold each variable's dimension names, coordinates and
attributes; ``transform_to_xarray`` builds the ``DataArray`` objects from that. The field names are
SmartRedis' (``_xarray_data_names``, ``_xarray_<variable>_dim_names``, ...), so a dataset written by
either library converts with the other. xarray is needed for ``transform_to_xarray`` only: the
``[xarray]`` extra installs it.
"""

from __future__ import annotations

import itertools
from typing import Any

from smartredis_io._client.helpers import typecheck, typecheck_stringlist
from smartredis_io.dataset import Dataset
from smartredis_io.error import RedisRuntimeError

__all__ = ["DatasetConverter", "get_data", "typecheck_stringlist"]

DATA_NAMES_FIELD = "_xarray_data_names"
_ROLES = ("dim", "coord", "attr")
_NULL = "null"


def get_data(dataset: Dataset, name: str, dtype: str) -> list[str]:
    """The field names recorded for variable ``name`` in role ``dtype`` (``dim``, ``coord`` or ``attr``)

    :param dataset: the dataset
    :type dataset: Dataset
    :param name: the data variable
    :type name: str
    :param dtype: the role: ``dim``, ``coord`` or ``attr``
    :type dtype: str
    :return: the recorded names (``["null"]`` when none were given)
    :rtype: list[str]
    :raises RedisKeyError: if nothing is recorded for the variable
    """
    return dataset.get_meta_strings(f"_xarray_{name}_{dtype}_names")[0].split(",")


def _as_names(names: str | list[str] | None, what: str) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, str):
        return [names]
    typecheck_stringlist(names, what, what[:-1])
    return names


def _names(dataset: Dataset, variable: str, role: str) -> list[str]:
    """The metadata field names recorded for ``variable`` in ``role`` (dim, coord or attr)."""
    recorded = get_data(dataset, variable, role)
    return [] if recorded == [_NULL] else recorded


def _import_xarray() -> Any:
    try:
        import xarray
    except ImportError as exc:
        raise RedisRuntimeError(
            "Optional package xarray must be installed; consider running "
            "`pip install 'lightning-storage-plugins[xarray]'`"
        ) from exc
    return xarray


class DatasetConverter:
    """Conversions between a Dataset and other data formats (xarray)."""

    @staticmethod
    def add_metadata_for_xarray(
        dataset: Dataset,
        data_names: str | list[str],
        dim_names: str | list[str],
        coord_names: str | list[str] | None = None,
        attr_names: str | list[str] | None = None,
    ) -> None:
        """Record in a dataset's metadata how its tensors form xarray DataArrays

        Each name in ``data_names`` is a tensor of the dataset; ``dim_names`` and ``attr_names``
        are metadata fields whose first string is a dimension name and an attribute value;
        ``coord_names`` are tensors that are coordinates of the data variables (recorded
        themselves with a call of their own).

        :param dataset: a Dataset instance
        :type dataset: Dataset
        :param data_names: variable data field name(s)
        :type data_names: list[str] or str
        :param dim_names: dimension field name(s)
        :type dim_names: list[str] or str
        :param coord_names: coordinate field name(s), defaults to None
        :type coord_names: list[str] or str, optional
        :param attr_names: attribute field name(s), defaults to None
        :type attr_names: list[str] or str, optional
        :raises TypeError: if an argument has the wrong type
        :raises RedisRuntimeError: if a name is an empty string
        """
        typecheck(dataset, "dataset", Dataset)
        variables = _as_names(data_names, "data_names")
        roles = {
            "dim": _as_names(dim_names, "dim_names"),
            "coord": _as_names(coord_names, "coord_names"),
            "attr": _as_names(attr_names, "attr_names"),
        }
        assert variables is not None
        for variable in variables:
            dataset.add_meta_string(DATA_NAMES_FIELD, variable)
            for role in _ROLES:
                names = roles[role]
                dataset.add_meta_string(f"_xarray_{variable}_{role}_names", ",".join(names) if names else _NULL)

    @staticmethod
    def transform_to_xarray(dataset: Dataset) -> dict[str, Any]:
        """Build an xarray DataArray for each data variable recorded with ``add_metadata_for_xarray``

        Variables named as coordinates of another variable become that variable's coordinates
        rather than DataArrays of their own.

        :param dataset: a Dataset instance
        :type dataset: Dataset
        :return: the DataArrays by variable name
        :rtype: dict[str, xarray.DataArray]
        :raises TypeError: if the argument is not a Dataset
        :raises RedisKeyError: if a recorded tensor or metadata field is not in the dataset
        :raises RedisRuntimeError: if xarray is not installed
        """
        typecheck(dataset, "dataset", Dataset)
        xarray = _import_xarray()
        variables = dataset.get_meta_strings(DATA_NAMES_FIELD)
        coords: dict[str, dict[str, tuple]] = {}
        for variable, other in list(itertools.permutations(variables, 2)):
            if other not in _names(dataset, variable, "coord"):
                continue
            if other in variables:
                variables.remove(other)
            dims = [dataset.get_meta_strings(field)[0] for field in _names(dataset, other, "dim")]
            attrs = {field: dataset.get_meta_strings(field)[0] for field in _names(dataset, other, "attr")}
            coords.setdefault(variable, {})[other] = (dims, dataset.get_tensor(other), attrs)
        arrays = {}
        for variable in variables:
            arrays[variable] = xarray.DataArray(
                name=variable,
                data=dataset.get_tensor(variable),
                coords=coords.get(variable),
                dims=[dataset.get_meta_strings(field)[0] for field in _names(dataset, variable, "dim")],
                attrs={field: dataset.get_meta_strings(field)[0] for field in _names(dataset, variable, "attr")},
            )
        return arrays
