#include "alloy/plan/cluster.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <set>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/core/parse.h"
#include "alloy/core/json_file.h"
#include "alloy/core/fs.h"
#include "alloy/core/text.h"

namespace alloy::plan {

namespace {

const std::vector<std::string> kKinds = {"cpu", "cuda", "mps", "rocm"};
const std::vector<std::string> kTopKeys = {"name",  "devices",      "groups",
                                           "links", "default_link", "intra_host_link"};
const std::vector<std::string> kDeviceKeys = {"name", "host", "kind", "type", "memory_gb", "speed", "flops"};
const std::vector<std::string> kRuleKeys = {"between", "within", "bandwidth_gbps", "latency_ms", "shared"};
const std::vector<std::string> kLinkKeys = {"bandwidth_gbps", "latency_ms"};

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// A link rule's end names a host or a group: the hosts it stands for, and whether H is one of them.
using Groups = std::map<std::string, std::vector<std::string>>;
std::vector<std::string> hosts_of(const Groups& groups, const std::string& end) {
  auto it = groups.find(end);
  return it == groups.end() ? std::vector<std::string>{end} : it->second;
}
bool in_group(const Groups& groups, const std::string& g, const std::string& h) {
  auto it = groups.find(g);
  return it != groups.end() && contains(it->second, h);
}
bool covers(const Groups& groups, const std::string& end, const std::string& h) { return end == h || in_group(groups, end, h); }

// Shortest text that reads back as the same double, so to_yaml round-trips exactly without
// printing 0.1 as 0.10000000000000001.
std::string fmt_double(double v) {
  char buf[64];
  for (int prec = 6; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

int line_of(const YAML::Node& n) { return n.Mark().line + 1; }

// Reads one YAML document into a ClusterSpec, remembering the line of each field so that
// validate() can point at it.
class YamlReader {
 public:
  YamlReader(ClusterSpec& spec, const std::string& source) : spec_(spec), source_(source) {}

  [[noreturn]] void fail(int line, const std::string& field, const std::string& msg) const {
    std::string where = source_;
    if (line > 0) where += " (line " + std::to_string(line) + ")";
    throw InputError(where, field.empty() ? msg : field + ": " + msg);
  }

  // Rejects keys outside ALLOWED and keys given twice (yaml-cpp keeps both silently).
  void check_keys(const YAML::Node& map, const std::vector<std::string>& allowed, const std::string& where) const {
    std::set<std::string> seen;
    for (const auto& kv : map) {
      if (!kv.first.IsScalar()) fail(line_of(kv.first), where, "keys must be plain names");
      const std::string key = kv.first.Scalar();
      if (!contains(allowed, key))
        fail(line_of(kv.first), "",
             "unknown key '" + key + "'" + (where.empty() ? "" : " in " + where) + " (expected one of " +
                 join(allowed, ", ") + ")");
      if (!seen.insert(key).second) fail(line_of(kv.first), where, "key '" + key + "' is given twice");
    }
  }

  std::string string_of(const YAML::Node& n, const std::string& field) const {
    if (!n.IsScalar()) fail(line_of(n), field, "must be a string");
    // Names end up in JSON (plans, profiles), which must be UTF-8; yaml-cpp passes any bytes.
    if (!is_valid_utf8(n.Scalar())) fail(line_of(n), field, "must be UTF-8 text");
    return n.Scalar();
  }

  double number_of(const YAML::Node& n, const std::string& field) const {
    if (!n.IsScalar()) fail(line_of(n), field, "must be a number");
    const std::string& text = n.Scalar();
    const auto v = parse_double(text);
    if (!v) fail(line_of(n), field, "must be a number, got '" + text + "'");
    return *v;
  }

  void remember(const std::string& field, const YAML::Node& n) { spec_.source_lines[field] = line_of(n); }

  void read(const YAML::Node& root) {
    if (!root || root.IsNull()) fail(0, "", "the file is empty; a cluster needs at least 'devices'");
    if (!root.IsMap()) fail(line_of(root), "", "top level must be a mapping with keys " + join(kTopKeys, ", "));
    check_keys(root, kTopKeys, "");
    if (root["name"]) spec_.name = string_of(root["name"], "name");
    if (root["devices"]) read_devices(root["devices"]);
    if (root["groups"]) read_groups(root["groups"]);
    if (root["default_link"]) read_link(root["default_link"], "default_link", spec_.default_link);
    if (root["intra_host_link"]) read_link(root["intra_host_link"], "intra_host_link", spec_.intra_host);
    // Rules read last: a rule without latency_ms takes the latency of the default it refines.
    if (root["links"]) read_rules(root["links"]);
  }

 private:
  void read_devices(const YAML::Node& seq) {
    if (seq.IsNull()) return;
    if (!seq.IsSequence()) fail(line_of(seq), "devices", "must be a list of devices");
    std::map<std::string, int> per_host;  // for default names "<host>-<index>"
    for (size_t i = 0; i < seq.size(); ++i) {
      const YAML::Node d = seq[i];
      const std::string f = "devices[" + std::to_string(i) + "]";
      if (!d.IsMap()) fail(line_of(d), f, "must be a mapping {name, host, kind, type, memory_gb, speed, flops}");
      check_keys(d, kDeviceKeys, f);
      remember(f, d);
      Device dev;
      if (!d["host"]) fail(line_of(d), f + ".host", "is missing; every device belongs to a host");
      dev.host = string_of(d["host"], f + ".host");
      if (d["name"]) {
        dev.name = string_of(d["name"], f + ".name");
      } else {
        dev.name = dev.host + "-" + std::to_string(per_host[dev.host]);
      }
      ++per_host[dev.host];
      if (d["kind"]) dev.kind = string_of(d["kind"], f + ".kind");
      // A device without a type is its own kind: every CUDA device one type, unless the file
      // tells them apart. That suits small pools of identical devices and keeps typos visible.
      dev.type = d["type"] ? string_of(d["type"], f + ".type") : dev.kind;
      if (d["memory_gb"]) dev.memory_gb = number_of(d["memory_gb"], f + ".memory_gb");
      if (d["speed"]) dev.speed = number_of(d["speed"], f + ".speed");
      if (d["flops"]) dev.flops = number_of(d["flops"], f + ".flops");
      for (const auto& k : kDeviceKeys)
        if (d[k]) remember(f + "." + k, d[k]);
      spec_.devices.push_back(std::move(dev));
    }
  }

  void read_groups(const YAML::Node& map) {
    if (map.IsNull()) return;
    if (!map.IsMap()) fail(line_of(map), "groups", "must be a mapping group -> [hosts]");
    std::set<std::string> seen;
    for (const auto& kv : map) {
      const std::string g = string_of(kv.first, "groups");
      const std::string f = "groups." + g;
      if (!seen.insert(g).second) fail(line_of(kv.first), f, "group '" + g + "' is given twice");
      remember(f, kv.first);
      std::vector<std::string> hosts;
      const YAML::Node list = kv.second;
      if (list.IsScalar()) {
        hosts.push_back(list.Scalar());
        remember(f + "[0]", list);
      } else if (list.IsSequence()) {
        for (size_t i = 0; i < list.size(); ++i) {
          const std::string hf = f + "[" + std::to_string(i) + "]";
          hosts.push_back(string_of(list[i], hf));
          remember(hf, list[i]);
        }
      } else if (!list.IsNull()) {
        fail(line_of(list), f, "must be a list of host names");
      }
      spec_.groups[g] = std::move(hosts);
    }
  }

  void read_link(const YAML::Node& map, const std::string& f, Link& link) {
    if (!map.IsMap()) fail(line_of(map), f, "must be a mapping {bandwidth_gbps, latency_ms}");
    check_keys(map, kLinkKeys, f);
    remember(f, map);
    if (map["bandwidth_gbps"]) link.bandwidth_gbps = number_of(map["bandwidth_gbps"], f + ".bandwidth_gbps");
    if (map["latency_ms"]) link.latency_ms = number_of(map["latency_ms"], f + ".latency_ms");
    for (const auto& k : kLinkKeys)
      if (map[k]) remember(f + "." + k, map[k]);
  }

  void read_rules(const YAML::Node& seq) {
    if (seq.IsNull()) return;
    if (!seq.IsSequence()) fail(line_of(seq), "links", "must be a list of {between: [a, b]} or {within: a} rules");
    for (size_t i = 0; i < seq.size(); ++i) {
      const YAML::Node r = seq[i];
      const std::string f = "links[" + std::to_string(i) + "]";
      if (!r.IsMap()) fail(line_of(r), f, "must be a mapping {between: [a, b] | within: a, bandwidth_gbps, latency_ms}");
      check_keys(r, kRuleKeys, f);
      remember(f, r);
      LinkRule rule;
      if (r["between"] && r["within"]) fail(line_of(r), f, "give either 'between' or 'within', not both");
      if (r["between"]) {
        const YAML::Node b = r["between"];
        if (!b.IsSequence() || b.size() != 2)
          fail(line_of(b), f + ".between", "must be a list of two host or group names, [a, b]");
        rule.a = string_of(b[0], f + ".between[0]");
        rule.b = string_of(b[1], f + ".between[1]");
        remember(f + ".between", b);
      } else if (r["within"]) {
        rule.a = rule.b = string_of(r["within"], f + ".within");
        remember(f + ".within", r["within"]);
      } else {
        fail(line_of(r), f, "needs 'between: [a, b]' or 'within: a'");
      }
      if (!r["bandwidth_gbps"]) fail(line_of(r), f + ".bandwidth_gbps", "is missing; a link rule must give its bandwidth");
      rule.link.bandwidth_gbps = number_of(r["bandwidth_gbps"], f + ".bandwidth_gbps");
      remember(f + ".bandwidth_gbps", r["bandwidth_gbps"]);
      if (r["latency_ms"]) {
        rule.link.latency_ms = number_of(r["latency_ms"], f + ".latency_ms");
        remember(f + ".latency_ms", r["latency_ms"]);
      } else {
        // Latency is mostly distance, which a bandwidth rule rarely changes: inherit it.
        bool within_host = rule.a == rule.b && spec_.groups.count(rule.a) == 0;
        rule.link.latency_ms = within_host ? spec_.intra_host.latency_ms : spec_.default_link.latency_ms;
      }
      if (r["shared"]) {
        const YAML::Node sh = r["shared"];
        bool v = false;
        if (!sh.IsScalar() || !YAML::convert<bool>::decode(sh, v)) fail(line_of(sh), f + ".shared", "must be true or false");
        if (v && rule.a == rule.b)
          fail(line_of(sh), f + ".shared",
               "applies to 'between' rules (one link joining two sites); a 'within' rule's pairs each have their own path");
        rule.shared = v;
        remember(f + ".shared", sh);
      }
      spec_.rules.push_back(std::move(rule));
    }
  }

  ClusterSpec& spec_;
  std::string source_;
};

}  // namespace

ClusterSpec ClusterSpec::from_yaml_string(const std::string& text, const std::string& source) {
  ClusterSpec spec;
  spec.source = source;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    std::string where = source;
    if (!e.mark.is_null()) where += " (line " + std::to_string(e.mark.line + 1) + ")";
    throw InputError(where, "not valid YAML: " + e.msg);
  }
  YamlReader(spec, source).read(root);
  spec.validate();
  return spec;
}

ClusterSpec ClusterSpec::load(const std::string& path) { return from_yaml_string(read_file(path), path); }

void ClusterSpec::validate() const {
  auto fail = [&](const std::string& field, const std::string& msg) {
    // The line of the field, else of the nearest enclosing one ("devices[2].kind" -> "devices[2]").
    int line = 0;
    for (std::string f = field; !f.empty();) {
      auto it = source_lines.find(f);
      if (it != source_lines.end()) {
        line = it->second;
        break;
      }
      auto cut = f.find_last_of(".[");
      if (cut == std::string::npos || cut == 0) break;
      f.resize(cut);
    }
    std::string where = source.empty() ? "cluster" : source;
    if (line > 0) where += " (line " + std::to_string(line) + ")";
    throw InputError(where, field + ": " + msg);
  };
  auto check_link = [&](const Link& l, const std::string& f) {
    if (!(l.bandwidth_gbps > 0) || !std::isfinite(l.bandwidth_gbps))
      fail(f + ".bandwidth_gbps", "must be a positive number of gigabits per second, got " + fmt_double(l.bandwidth_gbps));
    if (!(l.latency_ms >= 0) || !std::isfinite(l.latency_ms))
      fail(f + ".latency_ms", "must be >= 0 milliseconds, got " + fmt_double(l.latency_ms));
  };

  if (devices.empty()) fail("devices", "the cluster has no devices");
  std::map<std::string, size_t> names;
  std::set<std::string> host_set;
  for (size_t i = 0; i < devices.size(); ++i) {
    const Device& d = devices[i];
    const std::string f = "devices[" + std::to_string(i) + "]";
    const std::string who = " for device '" + d.name + "'";
    if (d.name.empty()) fail(f + ".name", "must not be empty");
    if (auto it = names.find(d.name); it != names.end())
      fail(f + ".name", "duplicate device name '" + d.name + "' (also devices[" + std::to_string(it->second) + "])");
    names[d.name] = i;
    if (d.host.empty()) fail(f + ".host", "is missing" + who + "; every device belongs to a host");
    host_set.insert(d.host);
    if (!contains(kKinds, d.kind)) fail(f + ".kind", "unknown kind '" + d.kind + "'" + who + " (expected " + join(kKinds, ", ") + ")");
    if (d.type.empty()) fail(f + ".type", "must not be empty" + who);
    if (!(d.memory_gb >= 0) || !std::isfinite(d.memory_gb))
      fail(f + ".memory_gb", "must be >= 0" + who + ", got " + fmt_double(d.memory_gb));
    if (!(d.speed > 0) || !std::isfinite(d.speed)) fail(f + ".speed", "must be > 0" + who + ", got " + fmt_double(d.speed));
    if (!(d.flops >= 0) || !std::isfinite(d.flops)) fail(f + ".flops", "must be >= 0" + who + ", got " + fmt_double(d.flops));
  }

  for (const auto& [g, hosts_in] : groups) {
    const std::string f = "groups." + g;
    if (g.empty()) fail("groups", "a group name must not be empty");
    // A rule names a host or a group; one name meaning both would make it ambiguous.
    if (host_set.count(g)) fail(f, "group '" + g + "' has the name of a host");
    if (hosts_in.empty()) fail(f, "group '" + g + "' has no hosts");
    std::set<std::string> seen;
    for (size_t i = 0; i < hosts_in.size(); ++i) {
      const std::string hf = f + "[" + std::to_string(i) + "]";
      if (!host_set.count(hosts_in[i]))
        fail(hf, "unknown host '" + hosts_in[i] + "' (no device has it; hosts: " + join(hosts(), ", ") + ")");
      if (!seen.insert(hosts_in[i]).second) fail(hf, "host '" + hosts_in[i] + "' is listed twice");
    }
  }

  std::map<std::pair<std::string, std::string>, size_t> pairs;
  for (size_t i = 0; i < rules.size(); ++i) {
    const LinkRule& r = rules[i];
    const std::string f = "links[" + std::to_string(i) + "]";
    for (const std::string* end : {&r.a, &r.b}) {
      if (!host_set.count(*end) && !groups.count(*end)) {
        std::string known = "hosts: " + join(hosts(), ", ");
        if (!groups.empty()) {
          std::vector<std::string> gs;
          for (const auto& kv : groups) gs.push_back(kv.first);
          known += "; groups: " + join(gs, ", ");
        }
        fail(f + (r.a == r.b ? ".within" : ".between"), "unknown host or group '" + *end + "' (" + known + ")");
      }
    }
    auto key = std::minmax(r.a, r.b);
    if (auto it = pairs.find({key.first, key.second}); it != pairs.end())
      fail(f, "a second rule for " + (r.a == r.b ? "within " + r.a : "between " + r.a + " and " + r.b) +
                  " (the first is links[" + std::to_string(it->second) + "])");
    pairs[{key.first, key.second}] = i;
    check_link(r.link, f);
    if (r.shared && r.a == r.b) fail(f + ".shared", "applies to 'between' rules (one link joining two sites), not to 'within " + r.a + "'");
    if (r.shared && r.a != r.b) {
      for (const auto& h : hosts_of(groups, r.a))
        if (covers(groups, r.b, h))
          fail(f + ".shared", "host '" + h + "' is on both ends (" + r.a + ", " + r.b + "): a shared line joins two separate sites");
    }
  }
  check_link(default_link, "default_link");
  check_link(intra_host, "intra_host_link");
}

std::string ClusterSpec::to_yaml() const {
  auto num = [](double v) { return fmt_double(v); };
  auto link_map = [&](YAML::Emitter& out, const Link& l) {
    out << YAML::Flow << YAML::BeginMap << YAML::Key << "bandwidth_gbps" << YAML::Value << num(l.bandwidth_gbps)
        << YAML::Key << "latency_ms" << YAML::Value << num(l.latency_ms) << YAML::EndMap;
  };
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << name;
  out << YAML::Key << "devices" << YAML::Value << YAML::BeginSeq;
  for (const auto& d : devices) {
    out << YAML::Flow << YAML::BeginMap;
    out << YAML::Key << "name" << YAML::Value << d.name;
    out << YAML::Key << "host" << YAML::Value << d.host;
    out << YAML::Key << "kind" << YAML::Value << d.kind;
    out << YAML::Key << "type" << YAML::Value << d.type;
    out << YAML::Key << "memory_gb" << YAML::Value << num(d.memory_gb);
    out << YAML::Key << "speed" << YAML::Value << num(d.speed);
    out << YAML::Key << "flops" << YAML::Value << num(d.flops);
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  if (!groups.empty()) {
    out << YAML::Key << "groups" << YAML::Value << YAML::BeginMap;
    for (const auto& [g, hs] : groups) out << YAML::Key << g << YAML::Value << YAML::Flow << hs;
    out << YAML::EndMap;
  }
  if (!rules.empty()) {
    out << YAML::Key << "links" << YAML::Value << YAML::BeginSeq;
    for (const auto& r : rules) {
      out << YAML::Flow << YAML::BeginMap;
      if (r.a == r.b) {
        out << YAML::Key << "within" << YAML::Value << r.a;
      } else {
        out << YAML::Key << "between" << YAML::Value << YAML::Flow << YAML::BeginSeq << r.a << r.b << YAML::EndSeq;
      }
      out << YAML::Key << "bandwidth_gbps" << YAML::Value << num(r.link.bandwidth_gbps);
      out << YAML::Key << "latency_ms" << YAML::Value << num(r.link.latency_ms);
      if (r.shared) out << YAML::Key << "shared" << YAML::Value << true;
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  out << YAML::Key << "default_link" << YAML::Value;
  link_map(out, default_link);
  out << YAML::Key << "intra_host_link" << YAML::Value;
  link_map(out, intra_host);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::vector<std::string> ClusterSpec::hosts() const {
  std::vector<std::string> hs;
  std::set<std::string> seen;
  for (const auto& d : devices)
    if (seen.insert(d.host).second) hs.push_back(d.host);
  return hs;
}

Link ClusterSpec::link(const std::string& host_a, const std::string& host_b) const {
  const int r = link_rule(host_a, host_b);
  if (r >= 0) return rules[static_cast<size_t>(r)].link;
  return host_a == host_b ? intra_host : default_link;
}

int ClusterSpec::link_rule(const std::string& host_a, const std::string& host_b) const {
  for (const std::string* h : {&host_a, &host_b}) {
    bool known = std::any_of(devices.begin(), devices.end(), [&](const Device& d) { return d.host == *h; });
    if (!known) throw InputError(source.empty() ? "cluster" : source, "no device is on host '" + *h + "'");
  }
  auto in_group = [&](const std::string& g, const std::string& h) { return alloy::plan::in_group(groups, g, h); };
  auto covers = [&](const std::string& end, const std::string& h) { return alloy::plan::covers(groups, end, h); };
  auto size_of = [&](const std::string& end) -> size_t {
    auto it = groups.find(end);
    return it == groups.end() ? 1 : it->second.size();
  };

  if (host_a == host_b) {
    // Traffic inside one host never crosses the network, so only a rule for this host applies.
    for (size_t i = 0; i < rules.size(); ++i)
      if (rules[i].a == host_a && rules[i].b == host_a) return static_cast<int>(i);
    return -1;
  }

  // Specificity: host pair (4) > host with a group (3) > group pair (2) > within a group (1);
  // at one level the rule covering fewer host pairs wins (a rack inside a region), then the later.
  int best_level = 0;
  size_t best_size = 0;
  int best = -1;
  for (size_t i = 0; i < rules.size(); ++i) {
    const LinkRule& r = rules[i];
    int level = 0;
    if (r.a == r.b) {
      if (in_group(r.a, host_a) && in_group(r.a, host_b)) level = 1;
    } else if ((covers(r.a, host_a) && covers(r.b, host_b)) || (covers(r.a, host_b) && covers(r.b, host_a))) {
      level = 2 + (groups.count(r.a) == 0) + (groups.count(r.b) == 0);
    }
    if (level == 0) continue;
    size_t size = size_of(r.a) * size_of(r.b);
    if (level > best_level || (level == best_level && size <= best_size)) {
      best_level = level;
      best_size = size;
      best = static_cast<int>(i);
    }
  }
  return best;
}

int ClusterSpec::shared_link(const std::string& host_a, const std::string& host_b) const {
  if (host_a == host_b) return -1;
  const int r = link_rule(host_a, host_b);
  if (r < 0 || !rules[static_cast<size_t>(r)].shared) return -1;
  const LinkRule& rule = rules[static_cast<size_t>(r)];
  // Overlapping ends (validate() refuses them for a shared rule): first to second when that reads right.
  const bool forward = covers(groups, rule.a, host_a) && covers(groups, rule.b, host_b);
  return 2 * r + (forward ? 0 : 1);
}

int ClusterSpec::device_index(const std::string& device_name) const {
  for (size_t i = 0; i < devices.size(); ++i)
    if (devices[i].name == device_name) return static_cast<int>(i);
  return -1;
}

std::vector<std::string> ClusterSpec::types() const {
  std::vector<std::string> ts;
  for (const auto& d : devices)
    if (!contains(ts, d.type)) ts.push_back(d.type);
  return ts;
}

// ---------------------------------------------------------------------------------------------
// PTAFM

namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::string file_stem(const std::string& path) { return std::filesystem::path(path).stem().string(); }

}  // namespace

PtafmCluster import_ptafm(const std::string& path) {
  const std::string text = read_file(path);
  auto fail = [&](int line, const std::string& msg) -> void {
    throw InputError(line > 0 ? path + " (line " + std::to_string(line) + ")" : path, msg);
  };

  struct Power {
    int a100 = 0, t4 = 0, line = 0;
  };
  struct Entry {
    double value = 0;
    int line = 0;
  };
  std::map<int, Power> power;                       // dc -> counts, in dc order
  std::map<std::pair<int, int>, Entry> lat, bw;     // (i <= j) -> value
  int num_stages = -1, num_stages_line = 0;
  std::string section;  // "" outside a section
  int section_line = 0;
  std::set<std::string> sections_seen;

  // The patterns below take digit strings of any length; one past int's range is an error, not
  // std::stoi's std::out_of_range.
  auto to_int = [&](const std::string& digits, int line) {
    try {
      return std::stoi(digits);
    } catch (const std::out_of_range&) {
      fail(line, "the number " + digits + " is out of range");
    }
    return 0;
  };
  // Each GPU becomes a device of the spec; a count past this is a typo (and would exhaust memory).
  constexpr int kMaxGpusPerDc = 4096;

  static const std::regex kNumStage(R"(NUM_STAGE\s*:\s*(-?\d+))");
  static const std::regex kPower(R"((\d+)\s*\[\s*(\d+)\s*,\s*(\d+)\s*\])");
  static const std::regex kPair(R"((\d+)\s+(\d+)\s+([-+0-9.eE]+))");

  std::istringstream in(text);
  std::string raw;
  int lineno = 0;
  while (std::getline(in, raw)) {
    ++lineno;
    std::string line = raw;
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    line = trim(line);
    if (line.empty()) continue;
    // libstdc++'s std::regex recurses once per character (some 300 bytes of stack each): a line of
    // 30,000 characters overflows an 8 MiB stack. PTAFM's lines are a few numbers.
    constexpr size_t kMaxLine = 256;
    if (line.size() > kMaxLine)
      fail(lineno, "line of " + std::to_string(line.size()) + " characters; the longest PTAFM line expected is " +
                       std::to_string(kMaxLine));
    std::smatch m;
    if (section.empty()) {
      if (std::regex_match(line, m, kNumStage)) {
        if (num_stages_line) fail(lineno, "NUM_STAGE is given twice (also line " + std::to_string(num_stages_line) + ")");
        num_stages = to_int(m[1], lineno);
        num_stages_line = lineno;
        if (num_stages < 1) fail(lineno, "NUM_STAGE must be >= 1, got " + m[1].str());
      } else if (line == "POWER_SECTION" || line == "LATENCY_SECTION" || line == "BANDWIDTH_SECTION") {
        if (!sections_seen.insert(line).second) fail(lineno, line + " is given twice");
        section = line;
        section_line = lineno;
      } else {
        fail(lineno, "expected NUM_STAGE:<n>, POWER_SECTION, LATENCY_SECTION or BANDWIDTH_SECTION, got '" + line + "'");
      }
      continue;
    }
    if (line == "end") {
      section.clear();
      continue;
    }
    if (section == "POWER_SECTION") {
      if (!std::regex_match(line, m, kPower))
        fail(lineno, "POWER_SECTION: expected '<dc> [<nA100>,<nT4>]', got '" + line + "'");
      int dc = to_int(m[1], lineno);
      if (dc < 1) fail(lineno, "POWER_SECTION: data-centre indices start at 1, got " + m[1].str());
      if (power.count(dc))
        fail(lineno, "POWER_SECTION: data centre " + std::to_string(dc) + " is given twice (also line " +
                         std::to_string(power[dc].line) + ")");
      const int a100 = to_int(m[2], lineno), t4 = to_int(m[3], lineno);
      if (a100 > kMaxGpusPerDc || t4 > kMaxGpusPerDc)
        fail(lineno, "POWER_SECTION: data centre " + std::to_string(dc) + " has more than " +
                         std::to_string(kMaxGpusPerDc) + " GPUs of a kind");
      power[dc] = Power{a100, t4, lineno};
    } else {
      auto& table = section == "LATENCY_SECTION" ? lat : bw;
      const std::string what = section == "LATENCY_SECTION" ? "<latency ms>" : "<bandwidth Gbps>";
      size_t pos = 0;
      double v = 0;
      bool ok = std::regex_match(line, m, kPair);
      if (ok) {
        try {
          v = std::stod(m[3], &pos);
        } catch (const std::logic_error&) {
          pos = 0;
        }
        ok = pos == m[3].str().size() && std::isfinite(v);
      }
      if (!ok) fail(lineno, section + ": expected '<i> <j> " + what + "', got '" + line + "'");
      int i = to_int(m[1], lineno), j = to_int(m[2], lineno);
      if (section == "LATENCY_SECTION" && v < 0) fail(lineno, section + ": latency must be >= 0, got " + m[3].str());
      if (section == "BANDWIDTH_SECTION" && !(v > 0)) fail(lineno, section + ": bandwidth must be > 0, got " + m[3].str());
      auto key = std::minmax(i, j);  // the matrices are symmetric; the file gives one triangle
      if (auto it = table.find({key.first, key.second}); it != table.end())
        fail(lineno, section + ": the pair " + std::to_string(i) + " " + std::to_string(j) + " is given twice (also line " +
                         std::to_string(it->second.line) + ")");
      table[{key.first, key.second}] = Entry{v, lineno};
    }
  }
  if (!section.empty()) fail(section_line, section + " has no closing 'end'");
  if (num_stages_line == 0) fail(0, "NUM_STAGE:<n> is missing");
  for (const char* s : {"POWER_SECTION", "LATENCY_SECTION", "BANDWIDTH_SECTION"})
    if (!sections_seen.count(s)) fail(0, std::string(s) + " is missing");
  if (power.empty()) fail(0, "POWER_SECTION lists no data centres");

  for (auto* table : {&lat, &bw}) {
    const std::string sec = table == &lat ? "LATENCY_SECTION" : "BANDWIDTH_SECTION";
    for (const auto& [key, e] : *table)
      for (int dc : {key.first, key.second})
        if (!power.count(dc))
          fail(e.line, sec + ": unknown data centre " + std::to_string(dc) + " (POWER_SECTION lists " +
                           std::to_string(power.size()) + ": " + [&] {
                             std::string s;
                             for (const auto& p : power) s += (s.empty() ? "" : ", ") + std::to_string(p.first);
                             return s;
                           }() + ")");
    for (const auto& pi : power)
      for (const auto& pj : power)
        if (pi.first <= pj.first && !table->count({pi.first, pj.first}))
          fail(0, sec + " has no entry for data centres " + std::to_string(pi.first) + " " + std::to_string(pj.first));
  }

  PtafmCluster out;
  out.num_stages = num_stages;
  ClusterSpec& spec = out.spec;
  spec.name = file_stem(path);
  spec.source = path;
  auto host_of = [](int dc) { return "dc" + std::to_string(dc); };
  for (const auto& [dc, p] : power) {
    const std::string h = host_of(dc);
    // PTAFM weighs an A100 as 7 T4s; speed carries that ratio to the emulator and to reports.
    for (int k = 0; k < p.a100; ++k) spec.devices.push_back({h + "-a100-" + std::to_string(k), h, "cuda", "A100", 40, 7.0, 312});
    for (int k = 0; k < p.t4; ++k) spec.devices.push_back({h + "-t4-" + std::to_string(k), h, "cuda", "T4", 16, 1.0, 65});
  }
  // A data centre without devices is no host; its links would name nothing, so they are dropped.
  auto has_devices = [&](int dc) { return power[dc].a100 + power[dc].t4 > 0; };
  for (const auto& [key, b] : bw) {
    if (!has_devices(key.first) || !has_devices(key.second)) continue;
    LinkRule r;
    r.a = host_of(key.first);
    r.b = host_of(key.second);
    // The diagonal is the network inside a data centre, kept as written even where it is not the
    // usual 200 (the published file has "6 6 0.693", most likely a copy of the "5 6" value).
    r.link.bandwidth_gbps = b.value;
    r.link.latency_ms = lat.at(key).value;
    spec.rules.push_back(r);
  }
  spec.validate();
  return out;
}

// ---------------------------------------------------------------------------------------------
// HeteroShard

ClusterSpec import_hetero_config(const std::string& path) {
  nlohmann::json j = read_json_file(path);
  auto fail = [&](const std::string& field, const std::string& msg) { throw InputError(path, field + ": " + msg); };
  if (!j.is_object()) fail("(top level)", "expected a JSON object with \"coordinator\" and \"workers\"");

  auto str_field = [&](const nlohmann::json& o, const char* key, const std::string& f) -> std::string {
    if (!o.contains(key) || o[key].is_null()) return "";
    if (!o[key].is_string()) fail(f + "." + key, "must be a string, got " + o[key].dump());
    return o[key].get<std::string>();
  };
  auto kind_of = [&](const nlohmann::json& o, const std::string& f) {
    std::string dev = str_field(o, "device", f);
    if (dev.empty() || dev == "auto") return std::string("cuda");  // HeteroShard picks CUDA when it has one
    if (dev == "cuda" || dev == "cpu" || dev == "mps") return dev;
    if (dev.rfind("cuda:", 0) == 0) return std::string("cuda");
    fail(f + ".device", "unknown device '" + dev + "' (expected auto, cuda, mps or cpu)");
    return dev;
  };
  auto count_of = [&](const nlohmann::json& o, const std::string& f) -> int {
    if (!o.contains("num_gpus")) return 1;
    const auto& v = o["num_gpus"];
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 4096)
      fail(f + ".num_gpus", "must be a whole number >= 1, got " + v.dump());
    return static_cast<int>(v.get<int64_t>());
  };

  ClusterSpec spec;
  spec.name = file_stem(path);
  spec.source = path;
  spec.links_described = false;
  std::map<std::string, int> per_host;
  // Entries that share a hostname are processes on one machine (HeteroShard runs one per GPU),
  // so they become devices of one host and share its network interface.
  auto add = [&](const std::string& host, const std::string& kind, int n) {
    for (int k = 0; k < n; ++k) {
      Device d;
      d.name = host + "-" + std::to_string(per_host[host]++);
      d.host = host;
      d.kind = kind;
      d.type = kind;
      d.memory_gb = 0;
      spec.devices.push_back(std::move(d));
    }
  };

  if (!j.contains("coordinator")) fail("coordinator", "is missing; the coordinator holds the first stage");
  const auto& c = j["coordinator"];
  if (!c.is_object()) fail("coordinator", "must be an object, got " + c.dump());
  std::string ch = str_field(c, "hostname", "coordinator");
  if (ch.empty()) ch = str_field(c, "ip", "coordinator");
  if (ch.empty()) ch = "coordinator";
  add(ch, kind_of(c, "coordinator"), count_of(c, "coordinator"));

  if (j.contains("workers")) {
    const auto& ws = j["workers"];
    if (!ws.is_array()) fail("workers", "must be an array, got " + ws.dump());
    for (size_t w = 0; w < ws.size(); ++w) {
      const std::string f = "workers[" + std::to_string(w) + "]";
      if (!ws[w].is_object()) fail(f, "must be an object, got " + ws[w].dump());
      std::string h = str_field(ws[w], "hostname", f);
      if (h.empty()) h = str_field(ws[w], "ip", f);
      if (h.empty()) h = "worker-" + (ws[w].contains("id") ? (ws[w]["id"].is_string() ? ws[w]["id"].get<std::string>() : ws[w]["id"].dump()) : std::to_string(w));
      add(h, kind_of(ws[w], f), count_of(ws[w], f));
    }
  }
  spec.validate();
  return spec;
}

}  // namespace alloy::plan
