#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <map>
#include <utility>

#include "alloy/core/error.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/profile.h"
#include "alloy/plan/profiler.h"
#include "expect_error.h"
#include "temp_dir.h"

using alloy::testing::error_of;
using alloy::testing::TempDir;
using alloy::InputError;
using alloy::plan::ClusterSpec;
using alloy::plan::Device;
using alloy::plan::Link;
using alloy::plan::LinkRule;
using alloy::plan::Profile;
namespace fs = std::filesystem;

namespace {

std::string yaml_error(const std::string& text) {
  return error_of([&] { ClusterSpec::from_yaml_string(text, "c.yaml"); });
}

const char* kThreeDevices = R"(name: three-devices
devices:
  - {name: fast, host: h0, kind: cpu, type: cpu-full, memory_gb: 8, speed: 1.0}
  - {name: mid, host: h1, kind: cuda, type: T4, memory_gb: 16, speed: 0.5, flops: 65}
  - {name: slow, host: h2, kind: cpu, type: cpu-quarter, memory_gb: 8, speed: 0.25}
groups:
  eu: [h0, h1]
links:
  - {between: [h0, h2], bandwidth_gbps: 0.1, latency_ms: 0.2}
  - {within: eu, bandwidth_gbps: 10, latency_ms: 0.05}
default_link: {bandwidth_gbps: 1, latency_ms: 0.1}
intra_host_link: {bandwidth_gbps: 100, latency_ms: 0.01}
)";

void expect_same(const ClusterSpec& a, const ClusterSpec& b) {
  EXPECT_EQ(a.name, b.name);
  ASSERT_EQ(a.devices.size(), b.devices.size());
  for (size_t i = 0; i < a.devices.size(); ++i) {
    const Device &x = a.devices[i], &y = b.devices[i];
    EXPECT_EQ(x.name, y.name);
    EXPECT_EQ(x.host, y.host);
    EXPECT_EQ(x.kind, y.kind);
    EXPECT_EQ(x.type, y.type);
    EXPECT_EQ(x.memory_gb, y.memory_gb);
    EXPECT_EQ(x.speed, y.speed);
    EXPECT_EQ(x.flops, y.flops);
  }
  EXPECT_EQ(a.groups, b.groups);
  ASSERT_EQ(a.rules.size(), b.rules.size());
  for (size_t i = 0; i < a.rules.size(); ++i) {
    EXPECT_EQ(a.rules[i].a, b.rules[i].a);
    EXPECT_EQ(a.rules[i].b, b.rules[i].b);
    EXPECT_EQ(a.rules[i].link.bandwidth_gbps, b.rules[i].link.bandwidth_gbps);
    EXPECT_EQ(a.rules[i].link.latency_ms, b.rules[i].link.latency_ms);
  }
  EXPECT_EQ(a.default_link.bandwidth_gbps, b.default_link.bandwidth_gbps);
  EXPECT_EQ(a.default_link.latency_ms, b.default_link.latency_ms);
  EXPECT_EQ(a.intra_host.bandwidth_gbps, b.intra_host.bandwidth_gbps);
  EXPECT_EQ(a.intra_host.latency_ms, b.intra_host.latency_ms);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ClusterSpec YAML

TEST(ClusterSpec, LoadsTheDocumentedExample) {
  ClusterSpec c = ClusterSpec::from_yaml_string(kThreeDevices, "c.yaml");
  EXPECT_EQ(c.name, "three-devices");
  ASSERT_EQ(c.devices.size(), 3u);
  EXPECT_EQ(c.devices[1].name, "mid");
  EXPECT_EQ(c.devices[1].kind, "cuda");
  EXPECT_EQ(c.devices[1].flops, 65);
  EXPECT_EQ(c.devices[2].speed, 0.25);
  EXPECT_EQ(c.hosts(), (std::vector<std::string>{"h0", "h1", "h2"}));
  EXPECT_EQ(c.types(), (std::vector<std::string>{"cpu-full", "T4", "cpu-quarter"}));
  EXPECT_EQ(c.device_index("slow"), 2);
  EXPECT_EQ(c.device_index("nope"), -1);
  EXPECT_EQ(c.link("h0", "h2").bandwidth_gbps, 0.1);
  EXPECT_EQ(c.link("h2", "h0").latency_ms, 0.2);
  EXPECT_EQ(c.link("h0", "h1").bandwidth_gbps, 10);
  EXPECT_EQ(c.link("h1", "h2").bandwidth_gbps, 1);  // default
  EXPECT_EQ(c.link("h1", "h1").bandwidth_gbps, 100);
  EXPECT_EQ(c.link_between_devices(0, 2).bandwidth_gbps, 0.1);
  EXPECT_DOUBLE_EQ(c.link("h0", "h2").bytes_per_s(), 0.1e9 / 8);
  EXPECT_DOUBLE_EQ(c.link("h0", "h2").latency_s(), 0.2e-3);
}

TEST(ClusterSpec, YamlRoundTrip) {
  ClusterSpec a = ClusterSpec::from_yaml_string(kThreeDevices, "c.yaml");
  a.devices[0].memory_gb = 0.1 + 0.2;  // not exactly representable in short decimal form
  a.rules[0].link.latency_ms = 1.0 / 3.0;
  const std::string text = a.to_yaml();
  ClusterSpec b = ClusterSpec::from_yaml_string(text, "round.yaml");
  expect_same(a, b);
  EXPECT_EQ(b.to_yaml(), text);
  EXPECT_HAS(text, "within: eu");
  EXPECT_HAS(text, "memory_gb: 8");  // short numbers stay short

  TempDir dir;
  std::string path = dir.write("c.yaml", text);
  ClusterSpec c = ClusterSpec::load(path);
  expect_same(a, c);
  EXPECT_EQ(c.source, path);
}

TEST(ClusterSpec, JsonIsYaml) {
  ClusterSpec c = ClusterSpec::from_yaml_string(
      R"({"name": "j", "devices": [{"host": "a", "kind": "cuda"}, {"host": "b"}],
          "links": [{"between": ["a", "b"], "bandwidth_gbps": 2}]})",
      "c.json");
  EXPECT_EQ(c.devices[0].name, "a-0");
  EXPECT_EQ(c.link("a", "b").bandwidth_gbps, 2);
}

TEST(ClusterSpec, DefaultsForNamesTypesAndRuleLatency) {
  ClusterSpec c = ClusterSpec::from_yaml_string(R"(devices:
  - {host: h0, kind: cuda}
  - {host: h1}
  - {host: h0, kind: cuda, type: A100}
  - {name: named, host: h0}
links:
  - {between: [h0, h1], bandwidth_gbps: 5}
  - {within: h0, bandwidth_gbps: 50}
default_link: {bandwidth_gbps: 1, latency_ms: 3}
intra_host_link: {latency_ms: 0.5}
)",
                                                "c.yaml");
  // Names count the devices of each host in file order.
  EXPECT_EQ(c.devices[0].name, "h0-0");
  EXPECT_EQ(c.devices[1].name, "h1-0");
  EXPECT_EQ(c.devices[2].name, "h0-1");
  EXPECT_EQ(c.devices[3].name, "named");
  // No type: the kind is the type.
  EXPECT_EQ(c.devices[0].type, "cuda");
  EXPECT_EQ(c.devices[1].kind, "cpu");
  EXPECT_EQ(c.devices[1].type, "cpu");
  EXPECT_EQ(c.devices[2].type, "A100");
  // A rule without latency keeps the latency of the default it refines.
  EXPECT_EQ(c.link("h0", "h1").latency_ms, 3);
  EXPECT_EQ(c.link("h0", "h0").latency_ms, 0.5);
  EXPECT_EQ(c.link("h0", "h0").bandwidth_gbps, 50);
  EXPECT_EQ(c.intra_host.bandwidth_gbps, 100);  // the other key keeps its built-in default
  EXPECT_EQ(c.link("h1", "h1").bandwidth_gbps, 100);
}

TEST(ClusterSpec, MostSpecificLinkRuleWins) {
  // Less specific rules come later, so "the last matching rule wins" would fail here.
  ClusterSpec c = ClusterSpec::from_yaml_string(R"(devices:
  - {host: h0}
  - {host: h1}
  - {host: h2}
  - {host: h3}
  - {host: h4}
  - {host: h0}
groups:
  eu: [h0, h1, h2]
  rack: [h0, h1]
  us: [h3, h4]
links:
  - {between: [h0, h3], bandwidth_gbps: 3, latency_ms: 70}
  - {between: [us, h0], bandwidth_gbps: 2, latency_ms: 75}
  - {within: rack, bandwidth_gbps: 50, latency_ms: 0.5}
  - {between: [eu, us], bandwidth_gbps: 1, latency_ms: 80}
  - {within: h0, bandwidth_gbps: 80, latency_ms: 0.02}
  - {within: eu, bandwidth_gbps: 10, latency_ms: 1}
default_link: {bandwidth_gbps: 0.5, latency_ms: 100}
intra_host_link: {bandwidth_gbps: 100, latency_ms: 0.01}
)",
                                                "c.yaml");
  auto bw = [&](const char* a, const char* b) {
    double x = c.link(a, b).bandwidth_gbps;
    EXPECT_EQ(x, c.link(b, a).bandwidth_gbps) << a << " " << b << " is not symmetric";
    return x;
  };
  EXPECT_EQ(bw("h0", "h3"), 3);     // host pair beats host-group and group pair
  EXPECT_EQ(bw("h0", "h4"), 2);     // host with a group beats the group pair
  EXPECT_EQ(bw("h1", "h4"), 1);     // group pair beats the defaults
  EXPECT_EQ(bw("h2", "h3"), 1);
  EXPECT_EQ(bw("h0", "h1"), 50);    // the smaller group (a rack inside a region) wins
  EXPECT_EQ(bw("h1", "h2"), 10);    // within a group
  EXPECT_EQ(bw("h3", "h4"), 0.5);   // nothing matches: default_link
  EXPECT_EQ(bw("h0", "h0"), 80);    // within a host
  EXPECT_EQ(bw("h1", "h1"), 100);   // a group rule is about the network, not inside one host
  EXPECT_EQ(c.link("h0", "h3").latency_ms, 70);
  EXPECT_EQ(c.link_between_devices(0, 5).bandwidth_gbps, 80);  // both devices on h0
  EXPECT_HAS(error_of([&] { c.link("h0", "h9"); }), "no device is on host 'h9'");
}

TEST(ClusterSpec, GroupPairBeatsWithinGroup) {
  ClusterSpec c = ClusterSpec::from_yaml_string(R"(devices: [{host: a}, {host: b}, {host: c}]
groups: {all: [a, b, c], left: [a], right: [b]}
links:
  - {within: all, bandwidth_gbps: 10}
  - {between: [left, right], bandwidth_gbps: 4}
)",
                                                "c.yaml");
  EXPECT_EQ(c.link("a", "b").bandwidth_gbps, 4);
  EXPECT_EQ(c.link("a", "c").bandwidth_gbps, 10);
}

// A shared rule is one link for every pair it covers, a way per direction; a more specific rule
// takes its pair off it (a private line), and the YAML keeps the flag.
TEST(ClusterSpec, SharedRuleIsOneLinkPerWay) {
  ClusterSpec c = ClusterSpec::from_yaml_string(R"(devices: [{host: e1}, {host: e2}, {host: u1}, {host: u2}]
groups: {eu: [e1, e2], us: [u1, u2]}
links:
  - {within: eu, bandwidth_gbps: 10}
  - {between: [eu, us], bandwidth_gbps: 0.1, shared: true}
  - {between: [e2, u2], bandwidth_gbps: 1}
)",
                                                "c.yaml");
  EXPECT_EQ(c.link("e1", "u1").bandwidth_gbps, 0.1);
  EXPECT_EQ(c.link_rule("e1", "u1"), 1);
  EXPECT_EQ(c.link_rule("e1", "e2"), 0);
  EXPECT_EQ(c.link_rule("e1", "e1"), -1);
  // eu -> us is way 2 x 1 + 0, us -> eu 2 x 1 + 1, from any pair the rule gives.
  EXPECT_EQ(c.shared_link("e1", "u1"), 2);
  EXPECT_EQ(c.shared_link("e2", "u1"), 2);
  EXPECT_EQ(c.shared_link("e1", "u2"), 2);
  EXPECT_EQ(c.shared_link("u1", "e1"), 3);
  EXPECT_EQ(c.shared_link("u2", "e1"), 3);
  EXPECT_EQ(c.shared_link("e2", "u2"), -1);  // its own line
  EXPECT_EQ(c.shared_link("e1", "e2"), -1);  // not a shared rule
  EXPECT_EQ(c.shared_link("e1", "e1"), -1);
  const ClusterSpec back = ClusterSpec::from_yaml_string(c.to_yaml(), "back.yaml");
  ASSERT_EQ(back.rules.size(), 3u);
  EXPECT_FALSE(back.rules[0].shared);
  EXPECT_TRUE(back.rules[1].shared);
  EXPECT_EQ(back.shared_link("u2", "e1"), 3);
  // Without the flag every pair is a path of its own.
  ClusterSpec own = c;
  own.rules[1].shared = false;
  EXPECT_EQ(own.shared_link("e1", "u1"), -1);
}

// ---------------------------------------------------------------------------------------------
// ClusterSpec validation: every message names the file, the field and, from YAML, the line.

TEST(ClusterSpecErrors, DuplicateDeviceNames) {
  std::string e = yaml_error("devices:\n  - {name: a, host: h0}\n  - {name: a, host: h1}\n");
  EXPECT_HAS(e, "c.yaml (line 3)");
  EXPECT_HAS(e, "devices[1].name");
  EXPECT_HAS(e, "duplicate device name 'a' (also devices[0])");
  // A default name can collide with an explicit one.
  e = yaml_error("devices:\n  - {name: h0-0, host: h1}\n  - {host: h0}\n");
  EXPECT_HAS(e, "duplicate device name 'h0-0'");
}

TEST(ClusterSpecErrors, UnknownHostInRuleOrGroup) {
  std::string e = yaml_error("devices: [{host: h0}, {host: h1}]\nlinks:\n  - {between: [h0, h9], bandwidth_gbps: 1}\n");
  EXPECT_HAS(e, "c.yaml (line 3)");
  EXPECT_HAS(e, "links[0].between");
  EXPECT_HAS(e, "unknown host or group 'h9'");
  EXPECT_HAS(e, "hosts: h0, h1");

  e = yaml_error("devices: [{host: h0}]\nlinks:\n  - {within: nowhere, bandwidth_gbps: 1}\n");
  EXPECT_HAS(e, "links[0].within");
  EXPECT_HAS(e, "'nowhere'");

  e = yaml_error("devices: [{host: h0}, {host: h1}]\ngroups:\n  eu:\n    - h0\n    - h7\n");
  EXPECT_HAS(e, "c.yaml (line 5)");
  EXPECT_HAS(e, "groups.eu[1]");
  EXPECT_HAS(e, "unknown host 'h7'");

  e = yaml_error("devices: [{host: h0}]\ngroups: {h0: [h0]}\n");
  EXPECT_HAS(e, "groups.h0");
  EXPECT_HAS(e, "has the name of a host");

  e = yaml_error("devices: [{host: h0}]\ngroups: {eu: []}\n");
  EXPECT_HAS(e, "groups.eu");
  EXPECT_HAS(e, "has no hosts");
}

TEST(ClusterSpecErrors, NonPositiveBandwidthAndNegativeLatency) {
  std::string e = yaml_error("devices: [{host: h0}, {host: h1}]\nlinks:\n  - {between: [h0, h1], bandwidth_gbps: 0}\n");
  EXPECT_HAS(e, "c.yaml (line 3)");
  EXPECT_HAS(e, "links[0].bandwidth_gbps");
  EXPECT_HAS(e, "must be a positive number");

  e = yaml_error("devices: [{host: h0}]\ndefault_link: {bandwidth_gbps: -2}\n");
  EXPECT_HAS(e, "c.yaml (line 2)");
  EXPECT_HAS(e, "default_link.bandwidth_gbps");

  e = yaml_error("devices: [{host: h0}]\nintra_host_link: {latency_ms: -1}\n");
  EXPECT_HAS(e, "intra_host_link.latency_ms");
  EXPECT_HAS(e, "must be >= 0");

  e = yaml_error("devices: [{host: h0}, {host: h1}]\nlinks:\n  - {between: [h0, h1]}\n");
  EXPECT_HAS(e, "links[0].bandwidth_gbps: is missing");
}

TEST(ClusterSpecErrors, DeviceFields) {
  std::string e = yaml_error("devices:\n  - {name: a, host: h0}\n  - {name: t, host: h0, kind: tpu}\n");
  EXPECT_HAS(e, "c.yaml (line 3)");
  EXPECT_HAS(e, "devices[1].kind");
  EXPECT_HAS(e, "unknown kind 'tpu' for device 't'");
  EXPECT_HAS(e, "cpu, cuda, mps, rocm");

  e = yaml_error("devices:\n  - {name: a, host: h0, type: ''}\n");
  EXPECT_HAS(e, "devices[0].type");
  EXPECT_HAS(e, "must not be empty");

  e = yaml_error("devices:\n  - name: a\n    host: h0\n    memory_gb: -1\n");
  EXPECT_HAS(e, "c.yaml (line 4)");  // the line of the value, not of the device
  EXPECT_HAS(e, "devices[0].memory_gb");
  EXPECT_HAS(e, "must be >= 0 for device 'a', got -1");

  e = yaml_error("devices:\n  - {name: a, memory_gb: 4}\n");
  EXPECT_HAS(e, "c.yaml (line 2)");
  EXPECT_HAS(e, "devices[0].host");
  EXPECT_HAS(e, "every device belongs to a host");

  e = yaml_error("devices:\n  - {host: h0, speed: 0}\n");
  EXPECT_HAS(e, "devices[0].speed");

  e = yaml_error("devices:\n  - {host: h0, memory_gb: lots}\n");
  EXPECT_HAS(e, "devices[0].memory_gb: must be a number, got 'lots'");

  e = yaml_error("devices:\n  - {host: [h0]}\n");
  EXPECT_HAS(e, "devices[0].host: must be a string");

  EXPECT_HAS(yaml_error("name: empty\n"), "devices: the cluster has no devices");
  EXPECT_HAS(yaml_error(""), "the file is empty");
}

TEST(ClusterSpecErrors, UnknownKeysSayWhichAndWhere) {
  std::string e = yaml_error("name: x\ndevice:\n  - {host: h0}\n");
  EXPECT_HAS(e, "c.yaml (line 2)");
  EXPECT_HAS(e, "unknown key 'device'");
  EXPECT_HAS(e, "expected one of name, devices");

  e = yaml_error("devices:\n  - host: h0\n  - host: h1\n    memroy_gb: 4\n");
  EXPECT_HAS(e, "c.yaml (line 4)");
  EXPECT_HAS(e, "unknown key 'memroy_gb' in devices[1]");

  e = yaml_error("devices: [{host: h0}, {host: h1}]\nlinks:\n  - {between: [h0, h1], bandwidth: 1}\n");
  EXPECT_HAS(e, "c.yaml (line 3)");
  EXPECT_HAS(e, "unknown key 'bandwidth' in links[0]");

  e = yaml_error("devices: [{host: h0}]\ndefault_link: {bandwidth_gbps: 1, latency: 2}\n");
  EXPECT_HAS(e, "unknown key 'latency' in default_link");

  e = yaml_error("devices:\n  - {host: h0, host: h1}\n");
  EXPECT_HAS(e, "key 'host' is given twice");
}

TEST(ClusterSpecErrors, RuleShape) {
  EXPECT_HAS(yaml_error("devices: [{host: h0}]\nlinks:\n  - {bandwidth_gbps: 1}\n"),
             "links[0]: needs 'between: [a, b]' or 'within: a'");
  EXPECT_HAS(yaml_error("devices: [{host: h0}]\nlinks:\n  - {between: [h0], bandwidth_gbps: 1}\n"),
             "links[0].between: must be a list of two");
  EXPECT_HAS(yaml_error("devices: [{host: h0}]\nlinks:\n  - {between: [h0, h0], within: h0, bandwidth_gbps: 1}\n"),
             "not both");
  std::string e = yaml_error(
      "devices: [{host: h0}, {host: h1}]\nlinks:\n  - {between: [h0, h1], bandwidth_gbps: 1}\n"
      "  - {between: [h1, h0], bandwidth_gbps: 2}\n");
  EXPECT_HAS(e, "c.yaml (line 4)");
  EXPECT_HAS(e, "links[1]: a second rule for between h1 and h0 (the first is links[0])");
  e = yaml_error("devices: [{host: h0}, {host: h1}]\ngroups: {g: [h0, h1]}\nlinks:\n  - {within: g, bandwidth_gbps: 1, shared: true}\n");
  EXPECT_HAS(e, "c.yaml (line 4)");
  EXPECT_HAS(e, "links[0].shared: applies to 'between' rules");
  EXPECT_HAS(yaml_error("devices: [{host: h0}, {host: h1}]\nlinks:\n  - {between: [h0, h1], bandwidth_gbps: 1, shared: maybe}\n"),
             "links[0].shared: must be true or false");
  EXPECT_HAS(yaml_error("devices: [{host: h0}, {host: h1}, {host: h2}]\ngroups: {a: [h0, h1], b: [h1, h2]}\nlinks:\n"
                        "  - {between: [a, b], bandwidth_gbps: 1, shared: true}\n"),
             "links[0].shared: host 'h1' is on both ends (a, b)");
}

TEST(ClusterSpecErrors, BadYamlAndMissingFile) {
  std::string e = yaml_error("devices: [{host: h0}\n");
  EXPECT_HAS(e, "c.yaml");
  EXPECT_HAS(e, "not valid YAML");
  e = error_of([] { ClusterSpec::load("/nonexistent/cluster.yaml"); });
  EXPECT_HAS(e, "/nonexistent/cluster.yaml");
}

TEST(ClusterSpecErrors, ValidateOnASpecBuiltInCode) {
  ClusterSpec c;
  c.devices.push_back({"a", "h0", "cuda", "A100", 40, 1, 0});
  c.devices.push_back({"b", "", "cuda", "A100", 40, 1, 0});
  std::string e = error_of([&] { c.validate(); });
  EXPECT_HAS(e, "cluster: devices[1].host: is missing for device 'b'");
  c.devices[1].host = "h1";
  c.source = "built.yaml";
  c.rules.push_back(LinkRule{"h0", "h2", Link{1, 1}});
  EXPECT_HAS(error_of([&] { c.validate(); }), "built.yaml: links[0].between: unknown host or group 'h2'");
  c.rules[0].b = "h1";
  EXPECT_EQ(error_of([&] { c.validate(); }), "");
}

// ---------------------------------------------------------------------------------------------
// PTAFM

namespace {

// shared/reference/ptafm-data-center-config.txt, verbatim.
const char* kPtafmReference = R"(NUM_STAGE:5

POWER_SECTION
1 [4,20]
2 [2,4]
3 [4,0]
4 [1,11]
5 [1,13]
6 [0,16]
7 [0,20]
end

LATENCY_SECTION
1 1 0.1
1 2 167
1 3 184
1 4 44
1 5 124
1 6 126
1 7 185
2 2 0.1
2 3 163
2 4 45
2 5 86
2 6 222
2 7 216
3 3 0.1
3 4 103
3 5 126
3 6 191
3 7 143
4 4 0.1
4 5 41
4 6 88
4 7 20
5 5 0.1
5 6 98
5 7 191
6 6 0.1
6 7 111
7 7 0.1
end

BANDWIDTH_SECTION
1 1 200
1 2 0.332
1 3 0.956
1 4 0.634
1 5 1.119
1 6 0.881
1 7 0.688
2 2 200
2 3 1.189
2 4 0.388
2 5 0.308
2 6 0.339
2 7 0.736
3 3 200
3 4 0.747
3 5 0.617
3 6 0.995
3 7 1.201
4 4 200
4 5 1.190
4 6 0.984
4 7 0.313
5 5 200
5 6 0.693
5 7 0.623
6 6 0.693
6 7 0.850
7 7 200
end
)";

// Every (i, j, value) line of one section of the text above.
std::map<std::pair<int, int>, double> ptafm_table(const std::string& text, const std::string& section) {
  std::map<std::pair<int, int>, double> t;
  std::istringstream in(text.substr(text.find(section)));
  std::string line;
  std::getline(in, line);
  while (std::getline(in, line) && line != "end") {
    std::istringstream ls(line);
    int i, j;
    double v;
    ls >> i >> j >> v;
    t[{i, j}] = v;
  }
  return t;
}

std::string ptafm_error(const std::string& text) {
  TempDir dir;
  std::string path = dir.write("dc.txt", text);
  return error_of([&] { alloy::plan::import_ptafm(path); });
}

}  // namespace

TEST(Ptafm, ImportsTheReferenceInstance) {
  TempDir dir;
  const std::string path = dir.write("ptafm-data-center-config.txt", kPtafmReference);
  alloy::plan::PtafmCluster p = alloy::plan::import_ptafm(path);
  const ClusterSpec& c = p.spec;
  EXPECT_EQ(p.num_stages, 5);
  EXPECT_EQ(c.source, path);
  EXPECT_EQ(c.hosts(), (std::vector<std::string>{"dc1", "dc2", "dc3", "dc4", "dc5", "dc6", "dc7"}));
  EXPECT_EQ(c.types(), (std::vector<std::string>{"A100", "T4"}));

  const std::map<std::string, std::pair<int, int>> power = {{"dc1", {4, 20}}, {"dc2", {2, 4}}, {"dc3", {4, 0}},
                                                            {"dc4", {1, 11}}, {"dc5", {1, 13}}, {"dc6", {0, 16}},
                                                            {"dc7", {0, 20}}};
  std::map<std::string, std::pair<int, int>> counted;
  for (const auto& d : c.devices) {
    EXPECT_EQ(d.kind, "cuda");
    if (d.type == "A100") {
      ++counted[d.host].first;
      EXPECT_EQ(d.memory_gb, 40);
      EXPECT_EQ(d.flops, 312);
      EXPECT_EQ(d.speed, 7.0);
    } else {
      ASSERT_EQ(d.type, "T4");
      ++counted[d.host].second;
      EXPECT_EQ(d.memory_gb, 16);
      EXPECT_EQ(d.flops, 65);
      EXPECT_EQ(d.speed, 1.0);
    }
  }
  for (const auto& [h, n] : power) {
    EXPECT_EQ(counted[h].first, n.first) << h << " A100s";
    EXPECT_EQ(counted[h].second, n.second) << h << " T4s";
  }
  EXPECT_EQ(c.devices.size(), 96u);
  EXPECT_EQ(c.devices[0].name, "dc1-a100-0");
  EXPECT_EQ(c.devices[7].name, "dc1-t4-3");
  EXPECT_GE(c.device_index("dc6-t4-15"), 0);
  EXPECT_EQ(c.device_index("dc6-a100-0"), -1);

  const auto lat = ptafm_table(kPtafmReference, "LATENCY_SECTION");
  const auto bw = ptafm_table(kPtafmReference, "BANDWIDTH_SECTION");
  ASSERT_EQ(lat.size(), 28u);
  ASSERT_EQ(bw.size(), 28u);
  for (int i = 1; i <= 7; ++i)
    for (int j = 1; j <= 7; ++j) {
      auto key = std::minmax(i, j);
      const std::string a = "dc" + std::to_string(i), b = "dc" + std::to_string(j);
      Link l = c.link(a, b);
      EXPECT_EQ(l.bandwidth_gbps, bw.at({key.first, key.second})) << a << "-" << b;
      EXPECT_EQ(l.latency_ms, lat.at({key.first, key.second})) << a << "-" << b;
    }
  EXPECT_EQ(c.link("dc1", "dc2").bandwidth_gbps, 0.332);
  EXPECT_EQ(c.link("dc7", "dc4").latency_ms, 20);
  EXPECT_EQ(c.link("dc1", "dc1").bandwidth_gbps, 200);
  // The published file says "6 6 0.693" where every other diagonal says 200; kept as written.
  EXPECT_EQ(c.link("dc6", "dc6").bandwidth_gbps, 0.693);
  EXPECT_EQ(c.link_between_devices(c.device_index("dc6-t4-0"), c.device_index("dc6-t4-1")).bandwidth_gbps, 0.693);

  // The import writes a spec Alloy's own YAML reads back unchanged.
  ClusterSpec again = ClusterSpec::from_yaml_string(c.to_yaml(), "ptafm.yaml");
  expect_same(c, again);
}

TEST(Ptafm, ReadsTheSharedReferenceWhenPresent) {
  const std::string shared = std::string(ALLOY_SHARED_DIR) + "/reference/ptafm-data-center-config.txt";
  if (!fs::exists(shared)) GTEST_SKIP() << shared << " is not on this machine";
  std::ifstream in(shared);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, kPtafmReference) << "the copy in this test is out of date";
  auto p = alloy::plan::import_ptafm(shared);
  EXPECT_EQ(p.spec.devices.size(), 96u);
}

TEST(Ptafm, MalformedFilesNameTheLine) {
  const std::string small = "NUM_STAGE:2\nPOWER_SECTION\n1 [1,2]\n2 [0,1]\nend\n"
                            "LATENCY_SECTION\n1 1 0.1\n1 2 40\n2 2 0.1\nend\n"
                            "BANDWIDTH_SECTION\n1 1 200\n1 2 1.5\n2 2 200\nend\n";
  auto p = ptafm_error(small);
  EXPECT_EQ(p, "");

  std::string e = ptafm_error("NUM_STAGE:2\nPOWER_SECTION\n1 [1,2]\n2 [0,1]\nend\n"
                              "LATENCY_SECTION\n1 1 0.1\n1 2 40\n2 2 0.1\nend\n");
  EXPECT_HAS(e, "dc.txt");
  EXPECT_HAS(e, "BANDWIDTH_SECTION is missing");

  e = ptafm_error("NUM_STAGE:2\nPOWER_SECTION\n1 [1,2]\n2 [0;1]\nend\n");
  EXPECT_HAS(e, "dc.txt (line 4)");
  EXPECT_HAS(e, "expected '<dc> [<nA100>,<nT4>]', got '2 [0;1]'");

  e = ptafm_error(small.substr(0, small.find("1 2 1.5")) + "1 9 1.5\n2 2 200\nend\n");
  EXPECT_HAS(e, "dc.txt (line 13)");
  EXPECT_HAS(e, "BANDWIDTH_SECTION: unknown data centre 9");

  e = ptafm_error(small.substr(0, small.find("1 2 40")) + "1 2 forty\n2 2 0.1\nend\n");
  EXPECT_HAS(e, "dc.txt (line 8)");
  EXPECT_HAS(e, "LATENCY_SECTION: expected '<i> <j> <latency ms>', got '1 2 forty'");

  e = ptafm_error(small.substr(0, small.find("1 2 1.5")) + "2 2 200\nend\n");
  EXPECT_HAS(e, "BANDWIDTH_SECTION has no entry for data centres 1 2");

  e = ptafm_error(small.substr(0, small.find("1 2 1.5")) + "1 2 1.5\n2 1 1.5\n2 2 200\nend\n");
  EXPECT_HAS(e, "dc.txt (line 14)");
  EXPECT_HAS(e, "the pair 2 1 is given twice (also line 13)");

  e = ptafm_error(small.substr(0, small.find("1 2 1.5")) + "1 2 0\n2 2 200\nend\n");
  EXPECT_HAS(e, "dc.txt (line 13)");
  EXPECT_HAS(e, "bandwidth must be > 0");

  e = ptafm_error(small.substr(0, small.rfind("end")));
  EXPECT_HAS(e, "dc.txt (line 11)");
  EXPECT_HAS(e, "BANDWIDTH_SECTION has no closing 'end'");

  e = ptafm_error(small.substr(small.find('\n') + 1));
  EXPECT_HAS(e, "NUM_STAGE:<n> is missing");

  e = ptafm_error("NUM_STAGE:2\nstages 3\n");
  EXPECT_HAS(e, "dc.txt (line 2)");
  EXPECT_HAS(e, "got 'stages 3'");

  e = ptafm_error("NUM_STAGE:2\nPOWER_SECTION\n1 [1,2]\n1 [0,1]\nend\n");
  EXPECT_HAS(e, "dc.txt (line 4)");
  EXPECT_HAS(e, "data centre 1 is given twice (also line 3)");

  e = error_of([] { alloy::plan::import_ptafm("/nonexistent/dc.txt"); });
  EXPECT_HAS(e, "/nonexistent/dc.txt");
}

TEST(Ptafm, DataCentreWithoutDevicesIsNoHost) {
  TempDir dir;
  std::string path = dir.write("dc.txt", "NUM_STAGE:1\nPOWER_SECTION\n1 [1,0]\n2 [0,0]\nend\n"
                                        "LATENCY_SECTION\n1 1 0.1\n1 2 40\n2 2 0.1\nend\n"
                                        "BANDWIDTH_SECTION\n1 1 200\n1 2 1.5\n2 2 200\nend\n");
  auto p = alloy::plan::import_ptafm(path);
  EXPECT_EQ(p.spec.hosts(), (std::vector<std::string>{"dc1"}));
  EXPECT_EQ(p.spec.rules.size(), 1u);
}

// ---------------------------------------------------------------------------------------------
// HeteroShard

TEST(HeteroShard, ImportsHostsAndDevices) {
  TempDir dir;
  std::string path = dir.write("hetero_config.json", R"({
  "version": "0.1.0",
  "coordinator": {"hostname": "macbook", "ip": "192.168.1.10", "device": "mps"},
  "workers": [
    {"id": 1, "hostname": "gpu-box", "ip": "192.168.1.20", "port": 9999, "device": "auto", "num_gpus": 2},
    {"id": 2, "hostname": "gpu-box", "ip": "192.168.1.20", "port": 10000, "device": "cuda"},
    {"id": 3, "ip": "192.168.1.30", "port": 9999, "device": "cpu"}
  ],
  "training": {"visualize": true, "visualization_format": "png", "log_level": "INFO"},
  "shard_plan": [{"id": "local", "start": 0, "end": 8}, {"id": 1, "start": 8, "end": 16},
                 {"id": 2, "start": 16, "end": 24}, {"id": 3, "start": 24, "end": 32, "is_last": true}],
  "checkpoint_dir": "./ckpt", "resume_step": 20
})");
  ClusterSpec c = alloy::plan::import_hetero_config(path);
  EXPECT_EQ(c.source, path);
  EXPECT_EQ(c.hosts(), (std::vector<std::string>{"macbook", "gpu-box", "192.168.1.30"}));
  ASSERT_EQ(c.devices.size(), 5u);
  EXPECT_EQ(c.devices[0].name, "macbook-0");
  EXPECT_EQ(c.devices[0].kind, "mps");
  EXPECT_EQ(c.devices[1].name, "gpu-box-0");
  EXPECT_EQ(c.devices[1].kind, "cuda");  // auto
  EXPECT_EQ(c.devices[2].name, "gpu-box-1");
  EXPECT_EQ(c.devices[3].name, "gpu-box-2");
  EXPECT_EQ(c.devices[4].kind, "cpu");
  for (const auto& d : c.devices) {
    EXPECT_EQ(d.type, d.kind);
    EXPECT_EQ(d.memory_gb, 0);
  }
  EXPECT_EQ(c.types(), (std::vector<std::string>{"mps", "cuda", "cpu"}));
  EXPECT_EQ(c.link("macbook", "gpu-box").bandwidth_gbps, c.default_link.bandwidth_gbps);
  ClusterSpec again = ClusterSpec::from_yaml_string(c.to_yaml(), "h.yaml");
  expect_same(c, again);
}

TEST(HeteroShard, Errors) {
  TempDir dir;
  auto err = [&](const std::string& text) {
    std::string path = dir.write("h.json", text);
    return error_of([&] { alloy::plan::import_hetero_config(path); });
  };
  std::string e = err(R"({"coordinator": {"hostname": "a"}, "workers": [{"id": 1, "hostname": "b", "device": "tpu"}]})");
  EXPECT_HAS(e, "h.json: workers[0].device: unknown device 'tpu'");
  e = err(R"({"workers": []})");
  EXPECT_HAS(e, "h.json: coordinator: is missing");
  e = err(R"({"coordinator": {"hostname": "a"}, "workers": [{"id": 1, "hostname": "b", "num_gpus": 0}]})");
  EXPECT_HAS(e, "workers[0].num_gpus: must be a whole number >= 1, got 0");
  e = err(R"({"coordinator": {"hostname": 5}})");
  EXPECT_HAS(e, "coordinator.hostname: must be a string");
  e = err("{not json");
  EXPECT_HAS(e, "h.json: not valid JSON");
}
