"""Header flags: each has a bit of its own (two merged features once both took 16, and a shadow read as "never")."""

from torchmetrics_varlen import _join_shadow, _protocol


def test_every_header_flag_has_its_own_bit():
    flags = {name: value for name, value in vars(_protocol).items() if name.startswith("FLAG_")}
    flags["FLAG_SHADOW"] = _join_shadow.FLAG_SHADOW  # the Join worker's flag travels in the same header word
    for name, value in flags.items():
        assert value > 0 and value & (value - 1) == 0, f"{name} = {value} is not a single bit"
    owners: dict[int, str] = {}
    for name, value in flags.items():
        assert value not in owners, f"{name} and {owners.get(value)} share the bit {value}"
        owners[value] = name
