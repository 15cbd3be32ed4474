"""Seeded fuzzing of registry writer schemas (tests/fuzz/writer_schemas.py) through the stage's
intake and finalize paths, with Schema Registry framing (no broker; the registry is
confluent-kafka's in-memory one).

Each case takes valid traffic (tests/fuzz/traffic.py), draws a writer schema for each input
record kind (logical types, annotations, added fields, reordered fields, now and then a
``fixed`` size that is not a count), registers both, and writes most records with them, the
rest with ours (a rolling upgrade). Then:

* resolving each schema id as the stage's resolver does (``AvroCodec.prefetch``) never raises:
  a refused schema is an answer, only an outage is retried;
* every record decodes to exactly what ours decodes (a compatible writer schema: same values,
  same Python types) or is refused with the schema's reason (WireError, not RegistryError);
* through the stage (tests/fuzz/driver.py) the invariants of tests/fuzz/invariants.py hold, no
  record of a compatible schema is dead-lettered, and every record of a refused one is.

    FUZZ_SCHEMA_CASES=3000 .venv/bin/python -m pytest -q -s tests/fuzz/test_writer_schemas.py
    FUZZ_SEED=7 ...                    # another seed (shared with tests/fuzz/test_fuzz.py)
    FUZZ_CASE=writer_schemas:12 ...    # replay one case of a failure report
"""

from __future__ import annotations

import logging
import os
import random
import time
import warnings
from collections import Counter

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from stage.finalize import ReassemblyConfig
from stage.publish.deadletters import UNDECODABLE
from stage.wire import AvroCodec, RegistryError, WireError, record_cap, schema_json
from tests.fuzz.driver import Driver
from tests.fuzz.invariants import check
from tests.fuzz.mutate import POOL
from tests.fuzz.test_fuzz import ONLY, SEED, CaseTimeout, time_bound
from tests.fuzz.traffic import CODECS, RECEIPTS, valid_traffic, workload_config
from tests.fuzz.writer_schemas import WriterSchema, draw

FAMILY = "writer_schemas"
TOTAL = int(os.environ.get("FUZZ_SCHEMA_CASES", "150"))
CASE_TIMEOUT_S = 30
NAMES = {RECEIPTS: "ReceiptEvent"}
OURS_SHARE = 0.2       # records written with our own schema id


def _name(role: str) -> str:
    return NAMES.get(role, "StagedCall")


_REGISTRY: list = []


def _registry() -> SchemaRegistryClient:
    """One in-memory registry for every case (building a client costs ~50 ms): each case's
    schemas get ids of their own, and identical texts the same id, as in a real registry."""
    if not _REGISTRY:
        _REGISTRY.append(SchemaRegistryClient.new_client({"url": "mock://fuzz-writer-schemas"}))
    return _REGISTRY[0]


class Case:
    """One case's registry, writer schemas and confluent-framed wires."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.traffic = valid_traffic(workload_config(rng.randrange(POOL)))
        self.registry = _registry()
        self.writers: dict[str, tuple[WriterSchema, int]] = {}
        self.ours: dict[str, int] = {}
        for role in sorted({r.role for r in self.traffic.records}):
            name = _name(role)
            writer = draw(rng, name)
            subject = f"{name}-value"
            self.ours[role] = self.registry.register_schema(subject, Schema(schema_json(name), "AVRO"))
            self.writers[role] = (writer, self.registry.register_schema(subject, Schema(writer.text, "AVRO")))
        self.wires, self.plain, self.by_writer = [], [], []
        for record in self.traffic.records:
            plain = record.wire()
            full = CODECS[record.role].decode(plain.value)
            writer, writer_id = self.writers[record.role]
            body, schema_id, mine = plain.value, self.ours[record.role], False
            if rng.random() >= OURS_SHARE:
                try:
                    body, schema_id, mine = writer.encode(full), writer_id, True
                except (ValueError, OverflowError):   # a long of ours that an int cannot hold:
                    pass                              # that producer could not write it either
            self.wires.append(plain.but(value=b"\x00" + schema_id.to_bytes(4, "big") + body))
            self.plain.append((plain, full))
            self.by_writer.append(mine)

        self.codecs: dict[str, AvroCodec] = {}

    def codec(self, role: str) -> AvroCodec:
        """The case's codec of ``role`` (the stage's default max_record_bytes): what the wire
        check resolves and decodes with, then the driven stage."""
        if role not in self.codecs:
            self.codecs[role] = AvroCodec(_name(role), framing="confluent", registry=self.registry)
        return self.codecs[role]

    def notes(self) -> list[str]:
        return [f"{_name(role)} #{sid} {'compatible' if w.compatible else 'refused'}: {w.notes[:6]}"
                for role, (w, sid) in sorted(self.writers.items())]


def _wire_violations(case: Case) -> list[str]:
    out = []
    codecs = {}
    for role, (writer, schema_id) in case.writers.items():
        codecs[role] = case.codec(role)
        for sid in (case.ours[role], schema_id):
            try:
                codecs[role].prefetch(sid)        # what the resolver runs off the poll thread
            except Exception as error:  # noqa: BLE001 - the violation
                out.append(f"resolving {_name(role)} schema id {sid} raised "
                           f"{type(error).__name__}: {error}")
    for wire, (plain, full), mine in zip(case.wires, case.plain, case.by_writer):
        writer = case.writers[wire.role][0]
        try:
            decoded = codecs[wire.role].decode(wire.value, fetch=False)
        except RegistryError as error:
            out.append(f"{_name(wire.role)}: a registry error for a registered schema: {error}")
            continue
        except WireError as error:
            if mine and not writer.compatible:
                continue
            out.append(f"{_name(wire.role)}: a record of a compatible schema refused: {error}")
            continue
        except Exception as error:  # noqa: BLE001 - the violation
            out.append(f"{_name(wire.role)}: decode raised {type(error).__name__}: {error}")
            continue
        if mine and not writer.compatible:
            out.append(f"{_name(wire.role)}: a record of a refused schema decoded")
        elif decoded != full:
            diff = sorted(k for k in full if decoded.get(k) != full[k])
            out.append(f"{_name(wire.role)}: decodes otherwise than ours in {diff}: "
                       + "; ".join(f"{k}={decoded[k]!r:.60} ({type(decoded[k]).__name__})" for k in diff[:3]))
    return out


_DRIVERS: dict[bool, Driver] = {}


def _driver(routes: bool) -> Driver:
    if routes not in _DRIVERS:
        _DRIVERS[routes] = Driver(ReassemblyConfig(router_replay=True) if routes else None)
    return _DRIVERS[routes]


def _stage_violations(case: Case, outcomes: Counter) -> list[str]:
    driver = _driver(case.traffic.routes is not None and case.rng.random() < 0.5)
    for role in case.writers:   # the case's codecs, resolved as the resolver would before decoding
        codec = driver.runtime.codecs[_name(role)] = case.codec(role)
        assert codec.max_record_bytes == record_cap(_name(role), driver.cfg.max_record_bytes)
        for schema_id in (case.ours[role], case.writers[role][1]):
            try:
                codec.prefetch(schema_id)
            except Exception as error:  # noqa: BLE001 - reported by _wire_violations
                return [f"not driven: the resolver would hold the partition for ever "
                        f"({type(error).__name__} resolving schema id {schema_id})"]
    result = driver.run(case.wires)
    out = []
    for i, (fate, mine) in enumerate(zip(result.fates, case.by_writer)):
        writer = case.writers[fate.wire.role][0]
        refused = mine and not writer.compatible
        outcomes[f"{fate.outcome}:{fate.reason}" if fate.reason else fate.outcome] += 1
        if refused and (fate.outcome, fate.reason) != ("dead_letter", UNDECODABLE):
            out.append(f"record {i} of a refused schema: {fate.outcome} {fate.reason} {fate.text[:200]}")
        elif not refused and fate.outcome == "dead_letter":
            out.append(f"record {i} dead-lettered: {fate.reason}: {fate.text[:300]}")
        fate.wire = case.plain[i][0]   # the invariants read records by their plain bytes
    out += [str(v) for v in check(result, driver)]
    outcomes["groups_published"] += len(result.published)
    return out


def _run_all() -> tuple[list, Counter, int]:
    if ONLY:
        name, index = ONLY.split(":")
        indices = [int(index)] if name == FAMILY else []
    else:
        indices = list(range(TOTAL))
    violations, outcomes = [], Counter()
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore", RuntimeWarning)
    try:
        for index in indices:
            rng = random.Random(f"{SEED}:{FAMILY}:{index}")
            case = Case(rng)
            for role, (writer, _) in case.writers.items():
                outcomes["schemas_compatible" if writer.compatible else "schemas_refused"] += 1
                for note in writer.notes:
                    if " as " in note:
                        outcomes[f"logical:{note.rsplit(' as ', 1)[1]}"] += 1
                    elif note.startswith("fixed size"):
                        outcomes["odd_fixed_sizes"] += 1
                    elif " for our " in note:
                        outcomes["promotions"] += 1
            outcomes["records_by_writer"] += sum(case.by_writer)
            try:
                with time_bound(CASE_TIMEOUT_S):
                    found = _wire_violations(case) + _stage_violations(case, outcomes)
            except CaseTimeout as error:
                found = [str(error)]
            violations += [(index, text, case.notes()) for text in found]
    finally:
        logging.disable(logging.NOTSET)
    return violations, outcomes, len(indices)


def test_writer_schemas():
    started = time.perf_counter()
    violations, outcomes, cases = _run_all()
    print(f"\n{FAMILY} (FUZZ_SEED={SEED}): {cases} cases in {time.perf_counter() - started:.1f}s, "
          f"outcomes {dict(outcomes.most_common(40))}")
    if not cases:
        pytest.skip(f"FUZZ_CASE={ONLY} is not a case of {FAMILY}")
    report = [f"{len(violations)} violations in {cases} cases of {FAMILY} (FUZZ_SEED={SEED}); "
              f"replay one with FUZZ_SEED={SEED} FUZZ_CASE={FAMILY}:<case> "
              ".venv/bin/python -m pytest -q -s tests/fuzz/test_writer_schemas.py"]
    report += [f"  case {i}: {text[:400]} | schemas: {notes}" for i, text, notes in violations[:12]]
    assert not violations, "\n".join(report)
    if not ONLY:   # a generator that silently stopped drawing a class fails here
        for needed in ("schemas_compatible", "schemas_refused", "odd_fixed_sizes", "logical:decimal",
                       "logical:timestamp-millis", "logical:uuid", "promotions", "groups_published",
                       f"dead_letter:{UNDECODABLE}"):
            assert outcomes[needed], f"{FAMILY} never produced {needed}: {dict(outcomes)}"
