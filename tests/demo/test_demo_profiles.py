"""`demo --profile`: the profile picks the workload sizes and the demo settings that suit them;
explicit options still win."""

from stage.cli import _parser
from stage.cli.demo import PROFILE_DEMO_DEFAULTS, PROFILE_NAMES, options
from stage.workload import PROFILE_NAMES as WORKLOAD_PROFILES
from stage.workload import profile


def _options(*argv):
    return options(_parser().parse_args(["demo", *argv]))


def test_the_demo_knows_every_workload_profile():
    assert PROFILE_NAMES == WORKLOAD_PROFILES == tuple(PROFILE_DEMO_DEFAULTS)


def test_default_demo_is_the_toy_profile():
    opts = _options()
    assert opts.profile == "toy" and opts.route_mode == "direct" and opts.group_timeout_ms == 3000
    assert opts.workload == profile("toy", faults=opts.workload.faults)
    assert (opts.workload.groups, opts.workload.group_size, opts.workload.routes) == (64, 4, (4, 2))


def test_agentic_moe_profile_sets_sizes_deferred_routes_and_a_longer_deadline():
    opts = _options("--profile", "agentic-moe")
    assert opts.route_mode == "deferred" and opts.group_timeout_ms == 120_000
    assert opts.workload.faults.tampered_tokens == 0.005 == opts.workload.faults.garbage
    assert _options().workload.faults.late_receipt == 0.03
    wl = opts.workload
    assert (wl.group_size, wl.routes, wl.route_dtypes, wl.rollout_tokens) == \
        (16, (48, 8), ("int8", "int16"), (32_768, 131_072))


def test_explicit_options_override_the_profile():
    opts = _options("--profile", "agentic-moe", "--groups", "1", "--group-size", "8", "--routes",
                    "direct", "--layers", "4", "--experts-per-token", "2", "--group-timeout-ms", "500")
    wl = opts.workload
    assert (wl.groups, wl.group_size, wl.routes, opts.route_mode, opts.group_timeout_ms) == \
        (1, 8, (4, 2), "direct", 500)
    assert wl.rollout_tokens == (32_768, 131_072)          # the rest stays the profile's
    assert _options("--profile", "agentic-moe", "--routes", "off").workload.routes is None


def test_frontier_profile_sets_its_route_dims_deferred_routes_and_a_longer_deadline():
    opts = _options("--profile", "frontier")
    assert opts.route_mode == "deferred" and opts.group_timeout_ms == 120_000
    assert opts.workload.faults.tampered_tokens == 0.005
    wl = opts.workload
    assert (wl.group_size, wl.routes, wl.route_dtypes, wl.num_experts, wl.rollout_tokens) == \
        (16, (40, 22), ("int16",), 512, (32_768, 131_072))


def test_the_record_cap_is_the_stages_unless_asked_and_reaches_every_client():
    from stage.demo.run import stage_config
    from stage.wire import DEFAULT_MAX_RECORD_BYTES, TopicNames
    assert _options().max_record_bytes == DEFAULT_MAX_RECORD_BYTES
    opts = _options("--profile", "frontier", "--max-record-bytes", str(64 << 20))
    assert opts.max_record_bytes == 64 << 20
    assert stage_config(opts, "b:9092", TopicNames(), "p").max_record_bytes == 64 << 20
