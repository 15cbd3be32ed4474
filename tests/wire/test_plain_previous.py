"""Plain framing across an upgrade: records of the previous release (without the fields appended
since, PLAIN_PREVIOUS_FIELDS) still decode, their new fields at the defaults; nothing else does."""

import io

import pytest
from fastavro import schemaless_writer

from stage.wire import AvroCodec, WireError
from stage.wire.codec import PLAIN_PREVIOUS_FIELDS, _previous_writer
from tests.wire.samples import ledger_entry, staged_call_full

SAMPLES = {"StagedCall": staged_call_full, "LedgerEntry": ledger_entry}


def _previous_bytes(name: str, value: dict) -> bytes:
    old = {k: v for k, v in value.items() if k not in PLAIN_PREVIOUS_FIELDS[name]}
    out = io.BytesIO()
    schemaless_writer(out, _previous_writer(name), old)
    return out.getvalue()


@pytest.mark.parametrize("name", sorted(PLAIN_PREVIOUS_FIELDS))
def test_a_record_of_the_previous_release_decodes_with_the_new_fields_at_their_defaults(name):
    codec = AvroCodec(name)
    value = SAMPLES[name]()
    current = codec.decode(codec.encode(value))
    old = _previous_bytes(name, value)
    assert len(old) < len(codec.encode(value))
    decoded = codec.decode(old)
    defaults = {"routes_ref": None, "max_route_offset": -1}
    assert decoded == {**current, **{f: defaults[f] for f in PLAIN_PREVIOUS_FIELDS[name]}}


@pytest.mark.parametrize("name", sorted(PLAIN_PREVIOUS_FIELDS))
def test_a_record_cut_short_anywhere_else_is_still_refused(name):
    codec = AvroCodec(name)
    value = SAMPLES[name]()
    data, old = codec.encode(value), _previous_bytes(name, value)
    for cut in range(1, len(data)):
        if data[:cut] == old:
            continue
        with pytest.raises(WireError):
            codec.decode(data[:cut])
