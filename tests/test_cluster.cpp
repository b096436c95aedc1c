#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cstdlib>  // mkdtemp
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

using alloy::InputError;
using alloy::plan::ClusterSpec;
using alloy::plan::Device;
using alloy::plan::Link;
using alloy::plan::LinkRule;
using alloy::plan::Profile;
namespace fs = std::filesystem;

namespace {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "alloy_cluster_XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name, const std::string& text) const {
    std::string p = path_ + "/" + name;
    std::ofstream(p) << text;
    return p;
  }
  std::string path(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The message of the InputError that F throws, or "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

std::string yaml_error(const std::string& text) {
  return error_of([&] { ClusterSpec::from_yaml_string(text, "c.yaml"); });
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

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
  std::string path = dir.file("c.yaml", text);
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
  std::string path = dir.file("dc.txt", text);
  return error_of([&] { alloy::plan::import_ptafm(path); });
}

}  // namespace

TEST(Ptafm, ImportsTheReferenceInstance) {
  TempDir dir;
  const std::string path = dir.file("ptafm-data-center-config.txt", kPtafmReference);
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
  std::string path = dir.file("dc.txt", "NUM_STAGE:1\nPOWER_SECTION\n1 [1,0]\n2 [0,0]\nend\n"
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
  std::string path = dir.file("hetero_config.json", R"({
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
    std::string path = dir.file("h.json", text);
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

// ---------------------------------------------------------------------------------------------
// Profile

namespace {

Profile sample_profile() {
  Profile p;
  p.model.layers = 6;
  p.model.hidden = 96;
  p.model.heads = 4;
  p.model.seq_len = 64;
  alloy::plan::DeviceProfile a;
  a.block_fwd = {1e-4, 2.5e-5};
  a.block_bwd = {2e-4, 5.1e-5};
  a.embed_fwd = {1e-5, 1e-6};
  a.embed_bwd = {2e-5, 2e-6};
  a.head_fwd = {3e-4, 7e-5};
  a.head_bwd = {6e-4, 1.4e-4};
  a.block_bwd.set_points({1, 2, 4}, {3e-4, 3.2e-4, 4.1e-4});
  a.optimizer_s_per_param = 1.0 / 3.0 * 1e-9;
  p.devices["cpu-full"] = a;
  alloy::plan::DeviceProfile b = a;
  b.block_fwd.per_sample_s *= 4;
  b.block_fwd.fixed_s = -1e-6;  // a fitted intercept slightly below zero is allowed
  p.devices["cpu-quarter"] = b;
  p.links.push_back({"h0", "h1", 1.2e8, 2e-4, 0});
  p.links.push_back({"h0", "h2", 1.25e7, 3e-3, 1.1e7});
  p.memory.param_bytes_per_block = 12345;
  p.memory.param_bytes_embed = 678;
  p.memory.param_bytes_head = 910;
  p.memory.act_bytes_per_sample_block = 1111;
  p.memory.act_bytes_per_sample_embed = 222;
  p.memory.act_bytes_per_sample_head = 333;
  p.memory.state_bytes_per_param_byte = 4;
  return p;
}

std::string profile_error(const nlohmann::json& j) {
  return error_of([&] { Profile::from_json(j, "p.json"); });
}

}  // namespace

TEST(Profile, JsonRoundTrip) {
  Profile p = sample_profile();
  TempDir dir;
  const std::string path = dir.path("profile.json");
  p.save(path);
  Profile q = Profile::load(path);
  EXPECT_EQ(alloy::model_to_json(q.model), alloy::model_to_json(p.model));
  ASSERT_EQ(q.devices.size(), 2u);
  for (const auto& [type, d] : p.devices) {
    const auto& e = q.devices.at(type);
    EXPECT_EQ(e.block_fwd.fixed_s, d.block_fwd.fixed_s);
    EXPECT_EQ(e.block_fwd.per_sample_s, d.block_fwd.per_sample_s);
    EXPECT_EQ(e.block_bwd.per_sample_s, d.block_bwd.per_sample_s);
    EXPECT_EQ(e.embed_fwd.fixed_s, d.embed_fwd.fixed_s);
    EXPECT_EQ(e.embed_bwd.per_sample_s, d.embed_bwd.per_sample_s);
    EXPECT_EQ(e.head_fwd.per_sample_s, d.head_fwd.per_sample_s);
    EXPECT_EQ(e.head_bwd.fixed_s, d.head_bwd.fixed_s);
    ASSERT_EQ(e.block_bwd.n, 3);
    EXPECT_EQ(e.block_bwd.m, d.block_bwd.m);
    EXPECT_EQ(e.block_bwd.t, d.block_bwd.t);
    EXPECT_EQ(e.block_fwd.n, 0);
    EXPECT_EQ(e.optimizer_s_per_param, d.optimizer_s_per_param);
  }
  ASSERT_EQ(q.links.size(), 2u);
  EXPECT_EQ(q.links[1].host_a, "h0");
  EXPECT_EQ(q.links[1].host_b, "h2");
  EXPECT_EQ(q.links[1].bytes_per_s, 1.25e7);
  EXPECT_EQ(q.links[1].latency_s, 3e-3);
  EXPECT_EQ(q.links[1].allreduce_bytes_per_s, 1.1e7);
  EXPECT_EQ(q.memory.param_bytes_per_block, 12345);
  EXPECT_EQ(q.memory.act_bytes_per_sample_head, 333);
  EXPECT_EQ(q.memory.state_bytes_per_param_byte, 4);
  EXPECT_EQ(q.to_json(), p.to_json());
  nlohmann::json j = p.to_json();
  EXPECT_EQ(j["format"], "alloy-profile");
  EXPECT_EQ(j["version"], 13);
  // Tensor-parallel sums per device pair round-trip and are optional.
  {
    EXPECT_FALSE(j.contains("tp_sums"));
    Profile c = p;
    c.tp_sums = {{"a0", "a1", 98304, 1.2e-3}};
    Profile d = Profile::from_json(c.to_json(), "p.json");
    ASSERT_EQ(d.tp_sums.size(), 1u);
    EXPECT_EQ(d.tp_sums[0].device_b, "a1");
    EXPECT_EQ(d.tp_sums[0].bytes, 98304);
    EXPECT_EQ(d.tp_sums[0].seconds, 1.2e-3);
    EXPECT_EQ(d.to_json(), c.to_json());
  }
  // The halves' shares round-trip and are optional (0: unknown).
  {
    Profile c = p;
    c.devices.at("cpu-full").attn_share_fwd = 0.55;
    c.devices.at("cpu-full").attn_share_bwd = 0.6;
    Profile d = Profile::from_json(c.to_json(), "p.json");
    EXPECT_EQ(d.devices.at("cpu-full").attn_share_fwd, 0.55);
    EXPECT_EQ(d.devices.at("cpu-full").attn_share_bwd, 0.6);
    EXPECT_EQ(d.devices.at("cpu-quarter").attn_share_fwd, 0.0);
    EXPECT_EQ(d.to_json(), c.to_json());
  }
  // An optional figure per device type: set on type ON it round-trips, type OFF reads UNSET and
  // writes no key, and each of BAD is refused naming the field (with WHY after it, where given).
  auto optional_figure = [&](double alloy::plan::DeviceProfile::*field, const std::string& key, const std::string& on, const std::string& off,
                             double value, double unset, const std::vector<double>& bad, const std::string& why) {
    Profile c = p;
    c.devices.at(on).*field = value;
    Profile d = Profile::from_json(c.to_json(), "p.json");
    EXPECT_EQ(d.devices.at(on).*field, value) << key;
    EXPECT_EQ(d.devices.at(off).*field, unset) << key;
    EXPECT_FALSE(c.to_json()["devices"][off].contains(key)) << key;
    EXPECT_EQ(d.to_json(), c.to_json()) << key;
    for (double v : bad) {
      nlohmann::json j = c.to_json();
      j["devices"][on][key] = v;
      EXPECT_HAS(profile_error(j), "devices." + on + "." + key + why) << key << " " << v;
    }
  };
  // zb-h1's weight share: a share.
  optional_figure(&alloy::plan::DeviceProfile::weight_share, "weight_share", "cpu-full", "cpu-quarter", 0.38, 0.0, {1.5}, "");
  // Communication's CPU time per byte: a plausible figure.
  optional_figure(&alloy::plan::DeviceProfile::comm_cpu_s_per_byte, "comm_cpu_s_per_byte", "cpu-quarter", "cpu-full", 1.8e-9, 0.0, {-1e-9, 2e-4},
                  ": must be in [0, 1e-4)");
  // What a tensor-parallel member computes whole: a share.
  optional_figure(&alloy::plan::DeviceProfile::tp_whole_share, "tp_whole_share", "cpu-full", "cpu-quarter", 0.17, 0.0, {1.0}, "");
  // A member's share per shard size: [fraction, share] pairs in order, each bounded.
  {
    Profile c = p;
    c.devices.at("cpu-full").tp_shard_shares = {{0.25, 0.41}, {0.5, 0.6}};
    const nlohmann::json cj = c.to_json();
    EXPECT_FALSE(cj["devices"]["cpu-quarter"].contains("tp_shard_shares"));
    Profile d = Profile::from_json(cj, "p.json");
    EXPECT_EQ(d.devices.at("cpu-full").tp_shard_shares, c.devices.at("cpu-full").tp_shard_shares);
    EXPECT_TRUE(d.devices.at("cpu-quarter").tp_shard_shares.empty());
    EXPECT_EQ(d.to_json(), cj);
    auto refused = [&](const nlohmann::json& pts, const std::string& what) {
      nlohmann::json j = cj;
      j["devices"]["cpu-full"]["tp_shard_shares"] = pts;
      EXPECT_HAS(profile_error(j), "devices.cpu-full.tp_shard_shares" + what) << pts.dump();
    };
    refused(0.5, ": must be an array of [fraction, share] pairs");
    refused({{0.5}}, "[0]: must be [fraction, share] (two numbers)");
    refused({{1.0, 1.0}}, "[0]: fraction must be in (0, 1)");
    refused({{0.5, 0.0}}, "[0]: share must be in (0, 1]");
    refused({{0.5, 0.6}, {0.25, 0.41}}, "[1]: must come after devices.cpu-full.tp_shard_shares[0]");
    refused({{0.25, 0.7}, {0.5, 0.6}}, "[1]: must come after");
  }
  // A CPU quota: its fraction of a core and its burst, written and read together, each bounded.
  {
    Profile c = p;
    c.devices.at("cpu-quarter").quota_fraction = 0.19;
    c.devices.at("cpu-quarter").quota_burst_s = 3.7e-3;
    const nlohmann::json cj = c.to_json();
    EXPECT_FALSE(cj["devices"]["cpu-full"].contains("quota_fraction"));
    EXPECT_FALSE(cj["devices"]["cpu-full"].contains("quota_burst_s"));
    Profile d = Profile::from_json(cj, "p.json");
    EXPECT_EQ(d.devices.at("cpu-quarter").quota_fraction, 0.19);
    EXPECT_EQ(d.devices.at("cpu-quarter").quota_burst_s, 3.7e-3);
    EXPECT_EQ(d.devices.at("cpu-full").quota_fraction, 1.0);
    EXPECT_EQ(d.devices.at("cpu-full").quota_burst_s, 0.0);
    EXPECT_EQ(d.to_json(), cj);
    for (double v : {0.0, 1.0, -0.5}) {
      nlohmann::json j = cj;
      j["devices"]["cpu-quarter"]["quota_fraction"] = v;
      EXPECT_HAS(profile_error(j), "devices.cpu-quarter.quota_fraction: must be in [0.001, 1)") << v;
    }
    for (double v : {0.0, 1.5}) {
      nlohmann::json j = cj;
      j["devices"]["cpu-quarter"]["quota_burst_s"] = v;
      EXPECT_HAS(profile_error(j), "devices.cpu-quarter.quota_burst_s: must be in (0, 1]") << v;
    }
    nlohmann::json half = cj;
    half["devices"]["cpu-quarter"].erase("quota_burst_s");
    EXPECT_HAS(profile_error(half), "devices.cpu-quarter.quota_burst_s: is missing");
  }
  // Version 11's burst_speedup: still read (checked, then dropped).
  {
    nlohmann::json v11 = p.to_json();
    v11["version"] = 11;
    v11["devices"]["cpu-quarter"]["burst_speedup"] = 2.1;
    EXPECT_EQ(Profile::from_json(v11, "p.json").to_json(), p.to_json());
    v11["devices"]["cpu-quarter"]["burst_speedup"] = 0.5;
    EXPECT_HAS(profile_error(v11), "devices.cpu-quarter.burst_speedup: must be in [1, 50]");
  }
  // Version 1 (lines without points) still reads.
  {
    nlohmann::json v1 = j;
    v1["version"] = 1;
    for (auto& [type, d] : v1["devices"].items())
      for (auto& [key, c] : d.items())
        if (c.is_object()) c.erase("points");
    EXPECT_EQ(Profile::from_json(v1, "p.json").devices.at("cpu-full").block_bwd.n, 0);
  }
  // Version 2 (no codec costs) still reads; codec costs round-trip.
  {
    nlohmann::json v2 = j;
    v2["version"] = 2;
    EXPECT_TRUE(Profile::from_json(v2, "p.json").devices.at("cpu-full").codecs.empty());
    Profile c = p;
    c.devices.at("cpu-full").codecs["dgc"] = {3e-9, 1e-9};
    Profile d = Profile::from_json(c.to_json(), "p.json");
    EXPECT_EQ(d.devices.at("cpu-full").codecs.at("dgc").encode_s_per_elem, 3e-9);
    EXPECT_EQ(d.to_json(), c.to_json());
  }
  // Version 3 (no step noise) reads as steady; the noise round-trips.
  {
    nlohmann::json v3 = j;
    v3["version"] = 3;
    for (auto& [type, d] : v3["devices"].items()) d.erase("step_noise");
    EXPECT_EQ(Profile::from_json(v3, "p.json").devices.at("cpu-full").step_noise, 0);
    Profile c = p;
    c.devices.at("cpu-full").step_noise = 0.05;
    EXPECT_EQ(Profile::from_json(c.to_json(), "p.json").devices.at("cpu-full").step_noise, 0.05);
  }
  // Free-form provenance is accepted.
  j["meta"] = {{"measured_on", "2024-01-01"}};
  EXPECT_EQ(profile_error(j), "");
  // allreduce_bytes_per_s is optional (0 = not measured).
  j["links"][0].erase("allreduce_bytes_per_s");
  EXPECT_EQ(Profile::from_json(j, "p.json").links[0].allreduce_bytes_per_s, 0);
}

TEST(Profile, LoraProfilesRoundTripAndMustMatchTheRun) {
  Profile p = sample_profile();
  EXPECT_FALSE(p.to_json().contains("lora"));  // a profile of full training writes no LoRA fields
  EXPECT_FALSE(p.to_json()["memory"].contains("frozen_bytes_per_block"));
  p.lora.rank = 8;
  p.lora.targets = "all";
  p.lora.base_dtype = "nf4";
  p.memory.frozen_bytes_per_block = 4567;
  p.memory.frozen_bytes_head = 89;
  Profile q = Profile::from_json(p.to_json(), "p.json");
  EXPECT_EQ(q.lora.rank, 8);
  EXPECT_EQ(q.lora.base_dtype, "nf4");
  EXPECT_EQ(q.memory.frozen_bytes_per_block, 4567);
  EXPECT_EQ(q.memory.frozen_bytes_head, 89);
  EXPECT_EQ(q.to_json(), p.to_json());
  alloy::Config run;
  run.model = p.model;
  EXPECT_NE(q.mismatch(run).find("this run is training every parameter"), std::string::npos) << q.mismatch(run);
  run.lora = p.lora;
  EXPECT_EQ(q.mismatch(run), "");
  run.lora.base_dtype = "int8";  // another storage: other dequantization times and memory
  EXPECT_NE(q.mismatch(run).find("int8"), std::string::npos);
  run.lora = p.lora;
  run.lora.alpha = 99;  // the scale changes no cost
  EXPECT_EQ(q.mismatch(run), "");
  run.model.layers += 1;
  EXPECT_NE(q.mismatch(run).find("another model"), std::string::npos);
  nlohmann::json bad = p.to_json();
  bad["lora"]["base_dtype"] = "int3";
  EXPECT_NE(profile_error(bad).find("lora.base_dtype"), std::string::npos) << profile_error(bad);
}

TEST(MicroBatchCost, InterpolatesMeasuredPointsAndExtendsWithTheFittedSlope) {
  alloy::plan::MicroBatchCost c{1e-3, 1e-3};  // the line says 2 ms at m = 1
  EXPECT_DOUBLE_EQ(c.at(3), 4e-3);
  c.set_points({1, 2, 4}, {3e-3, 3.5e-3, 5.5e-3});  // measured: m = 1 costs 3 ms
  EXPECT_DOUBLE_EQ(c.at(1), 3e-3);
  EXPECT_DOUBLE_EQ(c.at(2), 3.5e-3);
  EXPECT_DOUBLE_EQ(c.at(3), 4.5e-3);          // halfway between 2 and 4
  EXPECT_DOUBLE_EQ(c.at(8), 5.5e-3 + 4e-3);   // past the last point: the line's slope
  EXPECT_DOUBLE_EQ(c.at(0.5), 2.5e-3);        // below the first point: same slope, not below proportional
  // Sums keep the points: 2 * c + d, on the union of both grids.
  alloy::plan::MicroBatchCost d{0, 1e-3};
  d.set_points({1, 8}, {1e-3, 8e-3});
  alloy::plan::MicroBatchCost s;
  s.add(c, 2);
  s.add(d, 1);
  for (double m : {1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0}) EXPECT_NEAR(s.at(m), 2 * c.at(m) + d.at(m), 1e-15) << "m = " << m;
  EXPECT_DOUBLE_EQ(s.per_sample_s, 3e-3);
}

// The demo's half device (a 0.4-core quota) as `alloy profile` read its block forward: the point
// at 4 samples 30% over its neighbours per sample, where training measured 4 cheaper per sample
// than 1 (bench/README). Shaped, no size costs more per sample than a smaller one.
TEST(MicroBatchCost, MeasuredPointsNeverCostMorePerSampleAtALargerSize) {
  const std::vector<double> m{1, 2, 4, 8}, t{6.53e-3, 11.79e-3, 29.08e-3, 45.58e-3};
  const auto c = alloy::plan::MicroBatchCost::measured(m, t);
  ASSERT_EQ(c.n, 4);
  const double pooled = (6.53e-3 + 11.79e-3 / 2 + 29.08e-3 / 4) / 3;  // the first three per sample, averaged
  EXPECT_NEAR(c.at(1), pooled, 1e-12);
  EXPECT_NEAR(c.at(2), 2 * pooled, 1e-12);
  EXPECT_NEAR(c.at(4), 4 * pooled, 1e-12);
  EXPECT_DOUBLE_EQ(c.at(8), 45.58e-3);  // cheaper per sample already: kept
  // Readings that already have both shapes are kept as measured (the fast device's).
  const std::vector<double> clean{3.19e-3, 5.23e-3, 10.1e-3, 19.35e-3};
  const auto f = alloy::plan::MicroBatchCost::measured(m, clean);
  for (size_t i = 0; i < m.size(); ++i) EXPECT_DOUBLE_EQ(f.at(m[i]), clean[i]);
  // A time that falls with size is pooled as before (a larger micro-batch never takes less).
  const auto g = alloy::plan::MicroBatchCost::measured({1, 2}, {4e-3, 3e-3});
  EXPECT_DOUBLE_EQ(g.at(1), 3.5e-3);  // per sample, 4 and 1.5 ms stay; then 4 > 3 ms pooled
  EXPECT_DOUBLE_EQ(g.at(2), 3.5e-3);
}

RC_GTEST_PROP(MicroBatchCost, MeasuredPointsRiseWithSizeButNotPerSample, ()) {
  const int n = *rc::gen::inRange(1, 9);
  std::vector<double> m, t;
  double x = 0;
  for (int i = 0; i < n; ++i) {
    x += *rc::gen::inRange(1, 9);
    m.push_back(x);
    t.push_back(*rc::gen::inRange(1, 100000) * 1e-6);
  }
  const auto c = alloy::plan::MicroBatchCost::measured(m, t);
  RC_ASSERT(c.n == n);
  for (int i = 0; i < n; ++i) {
    RC_ASSERT(c.t[static_cast<size_t>(i)] > 0);
    if (i > 0) {
      const size_t k = static_cast<size_t>(i);
      RC_ASSERT(c.t[k] >= c.t[k - 1] * (1 - 1e-12));
      RC_ASSERT(c.t[k] / c.m[k] <= c.t[k - 1] / c.m[k - 1] * (1 + 1e-12));
    }
  }
  RC_ASSERT(c.per_sample_s >= 0);
  RC_ASSERT(c.fixed_s >= 0);
}

TEST(Profile, UnmeasuredTypesScaleMeasuredPointsBySpeed) {
  Profile p = sample_profile();
  p.devices.erase("cpu-quarter");
  const ClusterSpec spec = ClusterSpec::from_yaml_string(R"(
devices:
  - {name: a, host: h0, kind: cpu, type: cpu-full, memory_gb: 1, speed: 1.0}
  - {name: b, host: h1, kind: cpu, type: cpu-half, memory_gb: 1, speed: 0.5}
default_link: {bandwidth_gbps: 1, latency_ms: 0.1}
)", "c.yaml");
  alloy::plan::complete_profile(p, spec);
  ASSERT_EQ(p.devices.count("cpu-half"), 1u);
  const auto& full = p.devices.at("cpu-full").block_bwd;
  const auto& half = p.devices.at("cpu-half").block_bwd;
  ASSERT_EQ(half.n, full.n);
  for (double m : {1.0, 2.0, 3.0, 4.0, 16.0}) EXPECT_NEAR(half.at(m), 2 * full.at(m), 1e-15) << "m = " << m;
}

TEST(Profile, ActivationBytesPerSample) {
  Profile p = sample_profile();
  EXPECT_EQ(p.activation_bytes_per_sample(), 64.0 * 96 * 4);
  p.model.dtype = "float64";
  EXPECT_EQ(p.activation_bytes_per_sample(), 64.0 * 96 * 8);
  p.model.dtype = "bfloat16";
  EXPECT_HAS(error_of([&] { p.activation_bytes_per_sample(); }), "model.dtype");
}

TEST(Profile, ValidationErrorsNameFileAndField) {
  const nlohmann::json good = sample_profile().to_json();
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    return profile_error(j);
  };
  EXPECT_HAS(with([](auto& j) { j["format"] = "alloy-plan"; }), "p.json: format: \"alloy-plan\", not \"alloy-profile\"");
  EXPECT_HAS(with([](auto& j) { j.erase("format"); }), "p.json: format: is missing");
  EXPECT_HAS(with([](auto& j) { j["version"] = 14; }), "p.json: version: 14; this Alloy reads versions 1 to 13");
  EXPECT_HAS(with([](auto& j) { j["version"] = "5"; }), "p.json: version: \"5\"; this Alloy reads versions 1 to 13");
  const nlohmann::json sum = {{"device_a", "a0"}, {"device_b", "a1"}, {"bytes", 4096}, {"seconds", 1e-3}};
  EXPECT_HAS(with([&](auto& j) { j["tp_sums"] = {sum}; j["tp_sums"][0]["seconds"] = -1; }), "p.json: tp_sums[0].seconds: must be in [0, 60)");
  EXPECT_HAS(with([&](auto& j) { j["tp_sums"] = {sum}; j["tp_sums"][0]["bytes"] = 0; }), "p.json: tp_sums[0].bytes: must be > 0");
  EXPECT_HAS(with([&](auto& j) { j["tp_sums"] = {sum}; j["tp_sums"][0]["device_b"] = "a0"; }), "p.json: tp_sums[0]: must name two different devices");
  EXPECT_HAS(with([&](auto& j) { j["tp_sums"] = {sum}; j["tp_sums"][0]["rank"] = 1; }), "p.json: tp_sums[0].rank: unknown key");
  EXPECT_HAS(with([](auto& j) { j["tp_sums"] = 3; }), "p.json: tp_sums: must be an array");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["attn_share_fwd"] = 1.5; }), "p.json: devices.cpu-full.attn_share_fwd: must be in (0, 1)");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["step_noise"] = -0.1; }), "p.json: devices.cpu-full.step_noise: must be in [0, 1)");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["codecs"] = {{"dcg", {{"encode_s_per_elem", 1e-9}, {"decode_s_per_elem", 1e-9}}}}; }),
             "p.json: devices.cpu-full.codecs.dcg: is not a compression method");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["codecs"] = {{"dgc", {{"encode_s_per_elem", -1}, {"decode_s_per_elem", 0}}}}; }),
             "p.json: devices.cpu-full.codecs.dgc: costs must be >= 0");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_bwd"]["points"][1][0] = 1; }),
             "p.json: devices.cpu-full.block_bwd.points[1]: micro-batch sizes must increase, got 1 after 1");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_bwd"]["points"][2] = {4, -1}; }),
             "p.json: devices.cpu-full.block_bwd.points[2]: seconds must be finite and >= 0, got -1");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_bwd"]["points"][0] = 7; }),
             "p.json: devices.cpu-full.block_bwd.points[0]: must be [micro-batch size, seconds], got 7");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_bwd"]["points"][0][0] = 0; }),
             "points[0]: micro-batch size must be >= 1, got 0");
  EXPECT_HAS(with([](auto& j) { j.erase("devices"); }), "p.json: devices: is missing");
  EXPECT_HAS(with([](auto& j) { j["devices"] = nlohmann::json::object(); }), "p.json: devices: the profile has no device types");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_fwd"]["per_sample_s"] = -1; }),
             "p.json: devices.cpu-full.block_fwd.per_sample_s: must be >= 0");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["head_bwd"]["fixed_s"] = -1; }),
             "p.json: devices.cpu-full.head_bwd: fixed_s + per_sample_s");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["embed_fwd"].erase("fixed_s"); }),
             "p.json: devices.cpu-full.embed_fwd.fixed_s: is missing");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_fwd"]["fixed_s"] = "fast"; }),
             "devices.cpu-full.block_fwd.fixed_s: must be a number, got \"fast\"");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["blok_fwd"] = j["devices"]["cpu-full"]["block_fwd"]; }),
             "p.json: devices.cpu-full.blok_fwd: unknown key");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["optimizer_s_per_param"] = -1; }),
             "devices.cpu-full.optimizer_s_per_param: must be >= 0");
  EXPECT_HAS(with([](auto& j) { j["links"][1]["bytes_per_s"] = 0; }), "p.json: links[1].bytes_per_s: must be > 0");
  EXPECT_HAS(with([](auto& j) { j["links"][0]["latency_s"] = -1; }), "p.json: links[0].latency_s: must be >= 0");
  EXPECT_HAS(with([](auto& j) { j["links"][0].erase("host_b"); }), "p.json: links[0].host_b: is missing");
  EXPECT_HAS(with([](auto& j) { j["links"] = 3; }), "p.json: links: must be an array");
  EXPECT_HAS(with([](auto& j) { j["memory"]["param_bytes_head"] = -5; }), "p.json: memory.param_bytes_head: must be >= 0");
  EXPECT_HAS(with([](auto& j) { j["memory"]["state_bytes_per_param_byte"] = 0; }),
             "p.json: memory.state_bytes_per_param_byte: must be > 0");
  EXPECT_HAS(with([](auto& j) { j.erase("memory"); }), "p.json: memory: is missing");
  EXPECT_HAS(with([](auto& j) { j["extra"] = 1; }), "p.json: extra: unknown key");
  // The model section is checked like a config's model section.
  EXPECT_HAS(with([](auto& j) { j["model"]["heads"] = 5; }), "p.json: key 'model.heads'");
  EXPECT_HAS(with([](auto& j) { j["model"]["layerz"] = 5; }), "unknown key 'model.layerz'");
  EXPECT_HAS(with([](auto& j) { j.erase("model"); }), "p.json: model: is missing");
  EXPECT_HAS(profile_error(nlohmann::json::array()), "p.json: expected a JSON object");

  TempDir dir;
  std::string bad = dir.file("bad.json", "{\"format\": ");
  EXPECT_HAS(error_of([&] { Profile::load(bad); }), "bad.json: not valid JSON");
  EXPECT_HAS(error_of([&] { Profile::load(dir.path("missing.json")); }), "missing.json");
}
