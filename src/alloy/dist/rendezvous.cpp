#include "alloy/dist/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>

#include "alloy/core/error.h"
#include "alloy/core/log.h"

namespace alloy::dist {
namespace {
int parse_int(const std::string& text, const std::string& what) {
  try {
    size_t pos = 0;
    int v = std::stoi(text, &pos);
    if (pos == text.size()) return v;
  } catch (const std::logic_error&) {
  }
  throw InputError(what, "must be an integer, got '" + text + "'");
}
}  // namespace

EnvGetter process_env() {
  return [](const std::string& k) -> std::optional<std::string> {
    const char* v = std::getenv(k.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

std::string first_slurm_host(const std::string& nodelist) {
  std::string first;
  int depth = 0;
  for (char c : nodelist) {  // split at the first comma outside brackets
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first += c;
  }
  auto lb = first.find('[');
  if (lb == std::string::npos) return first;
  std::string prefix = first.substr(0, lb);
  std::string inner = first.substr(lb + 1, first.find(']') - lb - 1);
  std::string item = inner.substr(0, inner.find(','));
  return prefix + item.substr(0, item.find('-'));
}

int local_rank_from_env(const EnvGetter& env) {
  for (const char* k : {"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"})
    if (auto v = env(k)) return parse_int(*v, k);
  return -1;
}

Rendezvous resolve_rendezvous(const RendezvousFlags& f, const EnvGetter& env) {
  Rendezvous r;
  auto get = [&](const std::string& k) { return env(k); };
  if (f.rank >= 0 || f.world_size >= 0 || !f.dist_url.empty() || !f.master_addr.empty()) {
    r.source = "flags";
    if (f.rank < 0) throw InputError("--rank", "is required with --world-size / --dist-url / --master-addr");
    if (f.world_size < 1) throw InputError("--world-size", "is required and must be >= 1");
    r.rank = f.rank;
    r.world_size = f.world_size;
    if (!f.dist_url.empty()) {
      const std::string pre = "tcp://";
      if (f.dist_url.rfind(pre, 0) != 0) throw InputError("--dist-url", "must look like tcp://HOST:PORT, got '" + f.dist_url + "'");
      std::string hp = f.dist_url.substr(pre.size());
      auto colon = hp.rfind(':');
      if (colon == std::string::npos) throw InputError("--dist-url", "has no port: '" + f.dist_url + "'");
      r.master_addr = hp.substr(0, colon);
      r.master_port = parse_int(hp.substr(colon + 1), "--dist-url port");
    } else {
      if (!f.master_addr.empty()) r.master_addr = f.master_addr;
      if (f.master_port > 0) r.master_port = f.master_port;
    }
    if (auto lr = get("LOCAL_RANK")) r.local_rank = parse_int(*lr, "LOCAL_RANK");
  } else if (auto rank = get("RANK")) {
    r.source = "torchrun";
    r.rank = parse_int(*rank, "RANK");
    auto ws = get("WORLD_SIZE");
    if (!ws) throw InputError("WORLD_SIZE", "is not set although RANK is");
    r.world_size = parse_int(*ws, "WORLD_SIZE");
    if (auto a = get("MASTER_ADDR")) r.master_addr = *a;
    if (auto p = get("MASTER_PORT")) r.master_port = parse_int(*p, "MASTER_PORT");
    if (auto lr = get("LOCAL_RANK")) r.local_rank = parse_int(*lr, "LOCAL_RANK");
  } else if (auto procid = get("SLURM_PROCID")) {
    r.source = "slurm";
    r.rank = parse_int(*procid, "SLURM_PROCID");
    auto nt = get("SLURM_NTASKS");
    if (!nt) throw InputError("SLURM_NTASKS", "is not set although SLURM_PROCID is");
    r.world_size = parse_int(*nt, "SLURM_NTASKS");
    if (auto lid = get("SLURM_LOCALID")) r.local_rank = parse_int(*lid, "SLURM_LOCALID");
    if (auto a = get("MASTER_ADDR")) r.master_addr = *a;
    else if (auto nl = get("SLURM_JOB_NODELIST")) r.master_addr = first_slurm_host(*nl);
    if (auto p = get("MASTER_PORT")) r.master_port = parse_int(*p, "MASTER_PORT");
  } else if (get("OMPI_COMM_WORLD_RANK") || get("PMI_RANK")) {
    // mpirun / horovodrun: the launcher numbers the ranks but runs no store of c10d's kind.
    const bool ompi = get("OMPI_COMM_WORLD_RANK").has_value();
    const std::string rank_var = ompi ? "OMPI_COMM_WORLD_RANK" : "PMI_RANK", size_var = ompi ? "OMPI_COMM_WORLD_SIZE" : "PMI_SIZE",
                      local_size_var = ompi ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "MPI_LOCALNRANKS";
    r.source = "mpi";
    r.rank = parse_int(*get(rank_var), rank_var);
    auto ws = get(size_var);
    if (!ws) throw InputError(size_var, "is not set although " + rank_var + " is");
    r.world_size = parse_int(*ws, size_var);
    if (const int local = local_rank_from_env(env); local >= 0) r.local_rank = local;
    if (auto a = get("MASTER_ADDR")) {
      r.master_addr = *a;
    } else {
      // The default store address (this machine) holds only when every rank runs here.
      auto ls = get(local_size_var);
      if (!ls || parse_int(*ls, local_size_var) != r.world_size)
        throw InputError("MASTER_ADDR", "is not set, and the MPI launcher runs ranks on several machines: set it to the host of "
                                        "rank 0 for every rank (mpirun -x MASTER_ADDR=HOST, horovodrun: export it first)");
    }
    if (auto p = get("MASTER_PORT")) r.master_port = parse_int(*p, "MASTER_PORT");
  } else {
    r.source = "single process";
  }
  if (r.world_size < 1) throw InputError(r.source, "world size must be >= 1, got " + std::to_string(r.world_size));
  if (r.rank < 0 || r.rank >= r.world_size)
    throw InputError(r.source, "rank " + std::to_string(r.rank) + " is outside 0.." + std::to_string(r.world_size - 1));
  if (r.master_port <= 0 || r.master_port > 65535)
    throw InputError(r.source, "master port " + std::to_string(r.master_port) + " is not a TCP port");
  return r;
}

std::vector<std::string> local_addresses() {
  std::vector<std::string> out = {"localhost"};
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) == 0 && host[0]) out.push_back(host);
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* a = list; a; a = a->ifa_next) {
      if (!a->ifa_addr) continue;
      char buf[INET6_ADDRSTRLEN] = {};
      if (a->ifa_addr->sa_family == AF_INET)
        ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof buf);
      else if (a->ifa_addr->sa_family == AF_INET6)
        ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr, buf, sizeof buf);
      if (buf[0] && std::find(out.begin(), out.end(), buf) == out.end()) out.push_back(buf);
    }
    ::freeifaddrs(list);
  }
  return out;
}

int claim_rank_by_address(const std::vector<std::vector<std::string>>& addresses, const std::vector<std::string>& local,
                          const std::string& key, const std::string& where, const std::string& lock_dir) {
  // A stage's machine is its first address (hetero_config.json's ip, else its hostname). Every
  // machine answers to the loopback names, so they identify this one only in a file whose stages
  // are all loopback (a whole job on one machine): otherwise a coordinator at "localhost" would
  // match on every worker too.
  auto loopback = [](const std::string& a) { return a == "localhost" || a == "::1" || a.rfind("127.", 0) == 0; };
  bool only_loopback = true;
  for (const auto& rank : addresses) only_loopback = only_loopback && !rank.empty() && loopback(rank.front());
  std::vector<int> mine;
  for (size_t r = 0; r < addresses.size(); ++r) {
    if (addresses[r].empty()) continue;
    const std::string& a = addresses[r].front();
    if ((only_loopback || !loopback(a)) && std::find(local.begin(), local.end(), a) != local.end()) mine.push_back(static_cast<int>(r));
  }
  std::string names;
  for (const auto& l : local) names += (names.empty() ? "" : ", ") + l;
  if (mine.empty())
    throw InputError(where, "names no stage on this machine (" + names +
                                "): the coordinator's and the workers' ip or hostname must name the machines the command runs "
                                "on, or give --rank, --world-size and --master-addr");
  for (int r : mine) {
    const std::string path = lock_dir + "/alloy-rank-" + key + "-" + std::to_string(r) + ".lock";
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) throw InputError(path, std::string("cannot open the rank's lock file: ") + std::strerror(errno));
    // Held (the descriptor left open) for the life of the process: a second process on this
    // machine takes the next rank.
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return r;
    ::close(fd);
  }
  std::string ranks;
  for (int r : mine) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  throw InputError(where, "every stage it places on this machine (ranks " + ranks +
                              ") is already taken by another process here: one process per shard_plan entry");
}

Rendezvous rendezvous_by_address(const std::vector<std::vector<std::string>>& addresses, const std::string& coordinator,
                                 const std::string& file, int port_flag) {
  if (coordinator.empty())
    throw InputError(file, "coordinator.ip: needed to find the coordinator when every machine runs the same command "
                           "(or give --rank, --world-size and --master-addr)");
  for (size_t r = 0; r < addresses.size(); ++r)
    if (addresses[r].empty())
      throw InputError(file, "shard_plan[" + std::to_string(r) + "]: its " + (r == 0 ? "coordinator" : "worker") +
                                 " names no ip or hostname, so no machine can take that stage (or give --rank, --world-size "
                                 "and --master-addr)");
  Rendezvous rv;
  rv.world_size = static_cast<int>(addresses.size());
  rv.master_addr = coordinator;
  if (port_flag > 0) rv.master_port = port_flag;
  char key[32];
  std::snprintf(key, sizeof key, "%zx",
                std::hash<std::string>{}(std::filesystem::absolute(file).string() + ":" + std::to_string(rv.master_port)));
  rv.rank = claim_rank_by_address(addresses, local_addresses(), key, file);
  rv.source = "hetero_config";
  log_info(file + ": this process runs shard_plan[" + std::to_string(rv.rank) + "] (rank " + std::to_string(rv.rank) + " of " +
           std::to_string(rv.world_size) + "), the coordinator at " + rv.master_addr + ":" + std::to_string(rv.master_port));
  return rv;
}

}  // namespace alloy::dist
