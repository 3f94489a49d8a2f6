"""Criteo and Avazu as built-in schemas decode the bundled samples bit-identically to the fast decoders."""
import gzip

import numpy as np
import pytest

from stream_ctr.connectors.decode import decode_lines
from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.connectors.formats import AVAZU, CRITEO
from stream_ctr.connectors.schema_builtin import AVAZU_SCHEMA, CRITEO_SCHEMA
from stream_ctr.connectors.schema_decode import decode_records


def _data_lines(name: str) -> bytes:
    data = gzip.decompress(SAMPLE_PATHS[name].read_bytes())
    return data[data.index(b"\n") + 1:] if name == "avazu" else data


@pytest.mark.parametrize("name, fmt, schema", [("criteo", CRITEO, CRITEO_SCHEMA),
                                               ("avazu", AVAZU, AVAZU_SCHEMA)])
def test_builtin_schema_matches_the_fast_decoder(name, fmt, schema):
    data = _data_lines(name)
    fast, fast_rejected = decode_lines(data, fmt, "file:x", 0)
    general, general_rejected = decode_records(data, schema, "file:x", 0)
    assert (schema.n_keys, schema.n_dense) == (fmt.n_keys, fmt.n_dense)
    assert len(general) == len(fast) > 9000 and general_rejected == fast_rejected == []
    np.testing.assert_array_equal(general.keys, fast.keys)
    np.testing.assert_array_equal(general.dense.view(np.int32), fast.dense.view(np.int32))  # bits
    np.testing.assert_array_equal(general.labels, fast.labels)
    np.testing.assert_array_equal(general.event_time_ms, fast.event_time_ms)
    np.testing.assert_array_equal(general.offset, fast.offset)


def test_avazu_keys_in_the_same_order():
    assert AVAZU_SCHEMA.key_fields == AVAZU.key_fields
