// A running emulated cluster changed or cleaned from outside: links cut and restored, hosts taken
// down and brought back, and what killed clusters left behind removed (emulator.h).
#include "alloy/emu/emulator.h"
#include "alloy/emu/system.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"

namespace alloy::emu {
using namespace sys;

// ---------------------------------------------------------------------------------------------

namespace {
// The live emulated cluster: the one named, or the only one running. Returns its id.
std::string live_cluster(const std::string& id_in) {
  std::vector<std::string> live;
  for (const auto& f : list_dir(kStateDir)) {
    if (f.size() < 6 || f.compare(f.size() - 5, 5, ".json") != 0) continue;
    const std::string id = f.substr(0, f.size() - 5);
    if (!id_in.empty() && id != id_in) continue;
    try {
      auto j = nlohmann::json::parse(read_small(state_path(id)));
      if (owner_alive(j.value("pid", 0), j.value("start_time", 0ULL))) live.push_back(id);
    } catch (const std::exception&) {
    }
  }
  if (live.empty()) throw InputError(id_in.empty() ? "emu" : "--id", "no emulated cluster is running" + (id_in.empty() ? std::string() : " with id " + id_in));
  if (live.size() > 1) {
    std::string ids;
    for (const auto& i : live) ids += (ids.empty() ? "" : ", ") + i;
    throw InputError("--id", "several emulated clusters are running (" + ids + "): say which");
  }
  return live[0];
}
}  // namespace

std::string set_link(const std::string& host_a, const std::string& host_b, bool cut, const std::string& id_in) {
  if (::geteuid() != 0) throw Error("emu " + std::string(cut ? "cut" : "restore") + " needs root (it changes tc classes in the cluster's namespaces)");
  const std::vector<std::string> live{live_cluster(id_in)};
  const auto st = nlohmann::json::parse(read_small(state_path(live[0])));
  if (!st.contains("hosts") || !st.contains("shaping") || st["shaping"].empty())
    throw InputError("emu", "cluster " + live[0] + " has no shaped links to cut (launched with --no-net-limit, or one host)");
  const auto hosts = st["hosts"].get<std::vector<std::string>>();
  auto index = [&](const std::string& h) {
    auto it = std::find(hosts.begin(), hosts.end(), h);
    if (it == hosts.end()) {
      std::string known;
      for (const auto& x : hosts) known += (known.empty() ? "" : ", ") + x;
      throw InputError("emu", "no host '" + h + "' in cluster " + live[0] + " (hosts: " + known + ")");
    }
    return static_cast<size_t>(it - hosts.begin());
  };
  const size_t a = index(host_a), b = index(host_b);
  if (a == b) throw InputError("emu", "a link joins two different hosts");
  const std::string tc = st.value("tc", std::string("tc"));
  // A cut moves the pair's traffic to a class whose queue drops every packet (nothing gets
  // through; TCP retransmits as over a dead link); a restore points it back at its own class, which never ran
  // into the debt a rate change would leave. Filters are rebuilt per namespace from the recorded
  // classes and the set of cut pairs.
  std::set<std::string> cuts;
  if (st.contains("cut"))
    for (const auto& c : st["cut"]) cuts.insert(c.get<std::string>());
  for (const auto& key : {std::to_string(a) + ">" + std::to_string(b), std::to_string(b) + ">" + std::to_string(a)}) {
    if (cut) cuts.insert(key);
    else cuts.erase(key);
  }
  const char* kCutClass = "1:fff";
  for (const size_t k : {a, b}) {
    const std::string ns = st["shaping"].at(std::to_string(k) + ">" + std::to_string(k == a ? b : a))["netns"].get<std::string>();
    must({tc, "-n", ns, "class", "replace", "dev", "eth0", "parent", "1:", "classid", kCutClass, "htb", "rate", "8bit", "ceil", "8bit"},
         "cannot make the cut class in host " + hosts[k]);
    // Its queue holds nothing: every packet is dropped (htb's burst would let small ones through).
    must({tc, "-n", ns, "qdisc", "replace", "dev", "eth0", "parent", kCutClass, "handle", "fff:", "pfifo", "limit", "0"},
         "cannot make the cut class in host " + hosts[k]);
    must({tc, "-n", ns, "filter", "del", "dev", "eth0", "parent", "1:"}, "cannot change the links of host " + hosts[k]);
    for (const auto& [key, c] : st["shaping"].items()) {
      if (c["netns"].get<std::string>() != ns) continue;
      const size_t j = std::stoul(key.substr(key.find('>') + 1));
      const std::string dst = std::string(kSubnet) + std::to_string(j + 1) + "/32";
      const std::string what = std::string("cannot ") + (cut ? "cut" : "restore") + " the link " + hosts[k] + " -> " + hosts[j];
      if (cuts.count(key)) {
        must({tc, "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip", "dst", dst,
              "flowid", kCutClass},
             what);
        continue;
      }
      // As the emulator made them (emulator.cpp, add_link_classes): small packets first.
      const std::string small = c.value("small", std::string());
      if (!small.empty())
        must({tc, "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip", "dst", dst,
              "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", small},
             what);
      must({tc, "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "2", "u32", "match", "ip", "dst", dst,
            "flowid", c["classid"].get<std::string>()},
           what);
    }
  }
  nlohmann::json updated = st;
  updated["cut"] = std::vector<std::string>(cuts.begin(), cuts.end());
  write_file_atomic(state_path(live[0]), updated.dump(2) + "\n");
  return live[0];
}

std::string set_host(const std::string& host, bool down, const std::string& id_in) {
  if (::geteuid() != 0) throw Error("emu " + std::string(down ? "down" : "up") + " needs root (it changes the cluster's namespaces)");
  const std::string id = live_cluster(id_in);
  auto st = nlohmann::json::parse(read_small(state_path(id)));
  if (!st.contains("hosts")) throw InputError("emu", "cluster " + id + " records no hosts");
  const auto hosts = st["hosts"].get<std::vector<std::string>>();
  auto it = std::find(hosts.begin(), hosts.end(), host);
  if (it == hosts.end()) {
    std::string known;
    for (const auto& x : hosts) known += (known.empty() ? "" : ", ") + x;
    throw InputError("emu", "no host '" + host + "' in cluster " + id + " (hosts: " + known + ")");
  }
  // Down: unreachable first, so the ranks elsewhere see a dead peer rather than a goodbye.
  for (const auto& other : hosts)
    if (other != host) set_link(host, other, down, id);
  st = nlohmann::json::parse(read_small(state_path(id)));
  std::set<std::string> downs;
  if (st.contains("down"))
    for (const auto& d : st["down"]) downs.insert(d.get<std::string>());
  if (down) downs.insert(host);
  else downs.erase(host);
  st["down"] = std::vector<std::string>(downs.begin(), downs.end());
  write_file_atomic(state_path(id), st.dump(2) + "\n");
  if (down) {
    const std::string ns = std::string(kNetnsDir) + "/" + kPrefix + id + "-h" + std::to_string(it - hosts.begin());
    struct stat sb {};
    if (::stat(ns.c_str(), &sb) == 0) {
      const int n = kill_netns_processes(sb);
      log_info("emulator " + id + ": host " + host + " is down (" + std::to_string(n) + " processes on it killed)");
    }
  }
  return id;
}

bool host_down(const std::string& id, const std::string& host) {
  try {
    const auto st = nlohmann::json::parse(read_small(state_path(id)));
    if (!st.contains("down")) return false;
    for (const auto& d : st["down"])
      if (d.get<std::string>() == host) return true;
  } catch (const std::exception&) {
  }
  return false;
}

int clean_leftovers() {
  if (::geteuid() != 0) throw Error("emulator: cleaning needs root (namespaces and cgroups are root's); running as uid " + std::to_string(::geteuid()));
  ::mkdir(kStateDir, 0755);
  StateLock lock;
  int removed = 0;
  std::set<std::string> claimed;  // ids whose state file we read, live or just cleaned
  for (const auto& f : list_dir(kStateDir)) {
    const std::string path = std::string(kStateDir) + "/" + f;
    auto tmp = f.find(".tmp.");
    if (tmp != std::string::npos) {
      // A state file's write that never finished; its writer's pid ends the name.
      pid_t p = static_cast<pid_t>(std::atoi(f.c_str() + tmp + 5));
      if (!start_time_of(p)) ::unlink(path.c_str());
      continue;
    }
    if (f.size() < 6 || f.compare(f.size() - 5, 5, ".json") != 0) continue;
    const std::string id = f.substr(0, f.size() - 5);
    claimed.insert(id);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_small(path));
    } catch (const nlohmann::json::exception&) {
      j = nlohmann::json::object();  // unreadable: nobody can prove ownership, so it counts as dead
    }
    if (owner_alive(j.value("pid", 0), j.value("start_time", 0ULL))) continue;
    std::vector<std::string> netns, cgroups;
    if (j.contains("netns") && j["netns"].is_array())
      for (const auto& n : j["netns"]) netns.push_back(n.get<std::string>());
    if (j.contains("cgroups") && j["cgroups"].is_array())
      for (const auto& g : j["cgroups"]) cgroups.push_back(g.get<std::string>());
    auto [n, all] = remove_resources(id, netns, cgroups);
    removed += n;
    if (all) ::unlink(path.c_str());
    log_info("emulator: removed " + std::to_string(n) + " leftovers of " + id + " (owner pid " + std::to_string(j.value("pid", 0)) + " is gone)");
  }

  // Resources no state file claims: a crash between creating them and recording them cannot
  // happen (create() records first), so these come from a lost /run/alloy-emu. The lock keeps
  // launches from claiming ids meanwhile; the file is checked again all the same.
  std::set<std::string> orphan_ids;
  for (const auto& n : list_dir(kNetnsDir))
    if (auto id = id_of_resource(n); !id.empty() && !claimed.count(id)) orphan_ids.insert(id);
  for (const auto& n : list_dir(kCgroupRoot))
    if (auto id = id_of_resource(n); !id.empty() && !claimed.count(id)) orphan_ids.insert(id);
  for (const auto& id : orphan_ids) {
    if (file_exists(state_path(id))) continue;
    auto [n, all] = remove_resources(id, {}, {});
    (void)all;
    removed += n;
    log_info("emulator: removed " + std::to_string(n) + " leftovers of " + id + " (no owner recorded)");
  }
  return removed;
}

}  // namespace alloy::emu
