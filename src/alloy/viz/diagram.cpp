#include "alloy/viz/diagram.h"

#if ALLOY_HAVE_GRAPHVIZ
#include <graphviz/cgraph.h>
#include <graphviz/gvc.h>
#endif

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"

namespace alloy::viz {
namespace {

using nlohmann::json;

// The picture both writers draw, built once so DOT and Mermaid cannot disagree on content.
struct Node {
  std::string id;                  // safe identifier, never user text
  int group = -1;                  // index into Picture::groups
  std::vector<std::string> lines;  // plain text; lines[0] is the heading
  int pipeline = -1;               // -1: an idle device
};

struct Group {
  std::string id;
  std::vector<std::string> lines;  // plain text
  std::string host;                // empty unless the group is a cluster host
};

struct Edge {
  int from = 0, to = 0;  // indices into Picture::nodes
  std::string label;
};

struct HostLink {
  int a = 0, b = 0;  // indices into Picture::groups
  std::string label;
};

struct Picture {
  std::vector<std::string> note;  // title, sync groups, legend, problems
  std::vector<Group> groups;
  std::vector<Node> nodes;
  std::vector<Edge> activations, syncs;
  std::vector<HostLink> links;
};

// Light fills that stay readable with black text; a pipeline keeps its colour across hosts.
const char* const kPalette[] = {"#dbe9f6", "#fde2c8", "#d9f0d3", "#f3d9ef",
                                "#fff3b0", "#d6eef0", "#e8dff5", "#f6d5d5"};
const char* pipeline_fill(int p) { return kPalette[static_cast<size_t>(p) % (sizeof kPalette / sizeof kPalette[0])]; }

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// %g switches to exponents at 1e4 and beyond; bandwidths of 10000 Gbit/s should read as such.
std::string number(double v) { return std::fabs(v) >= 1e4 ? fmt("%.0f", v) : fmt("%.3g", v); }

std::string seconds(double s) {
  if (std::fabs(s) >= 0.1 || s == 0) return number(s) + " s";
  if (std::fabs(s) >= 1e-4) return number(s * 1e3) + " ms";
  return number(s * 1e6) + " us";
}

std::string bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(b) >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return number(b) + " " + units[u];
}

std::string link_label(const plan::Link& l) {
  return number(l.bandwidth_gbps) + " Gbit/s, " + number(l.latency_ms) + " ms";
}

// Half-block units [B, E) as blocks: "[0, 2.5)".
std::string range(int64_t b, int64_t e) {
  auto at = [](int64_t u) { return std::to_string(u / 2) + (u % 2 ? ".5" : ""); };
  return "[" + at(b) + ", " + at(e) + ")";
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    // Long data-parallel groups would push the note off the page; the count still tells the size.
    if (i == 12 && ranks.size() > 14) {
      s += ", ... (" + std::to_string(ranks.size()) + " ranks)";
      break;
    }
    s += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return s;
}

std::string ranks_heading(const std::vector<int>& ranks) {
  if (ranks.empty()) return "no rank";
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

// "6 samples x 10 micro-batches", with a short last one's size.
std::string micro_batches_text(const PipelinePlan& pl) {
  return std::to_string(pl.micro_batch_size) + " samples x " + std::to_string(pl.num_micro_batches) + " micro-batches" +
         (pl.short_last() ? " (the last of " + std::to_string(pl.last_size()) + ")" : "");
}

// One predicted entry as text: a number is a time (or a size for memory), an object a list of
// named figures whose unit its key's suffix gives.
std::string predicted_text(const json& v, bool memory) {
  auto one = [&](double x, const std::string& key) {
    auto ends = [&](const std::string& suf) {
      return key.size() >= suf.size() && key.compare(key.size() - suf.size(), suf.size(), suf) == 0;
    };
    if (ends("_s")) return key.substr(0, key.size() - 2) + " " + seconds(x);
    if (ends("_bytes")) return key.substr(0, key.size() - 6) + " " + bytes(x);
    if (key.empty()) return memory ? bytes(x) : seconds(x);
    return key + " " + number(x);
  };
  std::string text;
  if (v.is_number()) {
    text = one(v.get<double>(), "");
  } else if (v.is_object()) {
    for (auto it = v.begin(); it != v.end(); ++it)
      if (it.value().is_number()) text += (text.empty() ? "" : ", ") + one(it.value().get<double>(), it.key());
  }
  if (text.empty()) return "";
  return (memory ? "memory " : "predicted ") + text;
}

// Spreads predicted.KEY over the stages (plan order); entries stay null where nothing applies.
std::vector<json> per_stage(const json& pred, const std::string& key, const Plan& plan, size_t total,
                            std::vector<std::string>& problems) {
  std::vector<json> out(total);
  if (!pred.is_object() || !pred.contains(key)) return out;
  const json& v = pred[key];
  if (v.is_null() || (v.is_array() && v.empty())) return out;
  auto mismatch = [&](const std::string& why) {
    problems.push_back("predicted." + key + " " + why + "; not shown");
    return std::vector<json>(total);
  };
  if (v.is_array()) {
    bool nested = std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_array(); });
    if (nested) {
      if (v.size() != plan.pipelines.size())
        return mismatch("has " + std::to_string(v.size()) + " pipelines, the plan " + std::to_string(plan.pipelines.size()));
      size_t k = 0;
      for (size_t p = 0; p < plan.pipelines.size(); ++p) {
        if (v[p].size() != plan.pipelines[p].stages.size())
          return mismatch("[" + std::to_string(p) + "] has " + std::to_string(v[p].size()) + " stages, the plan's pipeline " +
                          std::to_string(plan.pipelines[p].stages.size()));
        for (const auto& e : v[p]) out[k++] = e;
      }
      return out;
    }
    if (v.size() != total)
      return mismatch("has " + std::to_string(v.size()) + " entries for " + std::to_string(total) + " stages");
    for (size_t i = 0; i < total; ++i) out[i] = v[i];
    return out;
  }
  if (v.is_object()) {
    std::map<int, size_t> stage_of_rank;
    size_t k = 0;
    for (const auto& pl : plan.pipelines)
      for (const auto& st : pl.stages) {
        for (int r : st.ranks) stage_of_rank.emplace(r, k);
        ++k;
      }
    for (auto it = v.begin(); it != v.end(); ++it) {
      char* end = nullptr;
      long r = std::strtol(it.key().c_str(), &end, 10);
      if (it.key().empty() || *end != '\0' || !stage_of_rank.count(static_cast<int>(r)))
        return mismatch("names '" + it.key() + "', which is not a rank of the plan");
      out[stage_of_rank[static_cast<int>(r)]] = it.value();
    }
    return out;
  }
  return mismatch("is neither an array nor an object keyed by rank");
}

Picture build(const DiagramInput& in) {
  if (!in.plan) throw Error("diagram: no plan given");
  const Plan& plan = *in.plan;
  const plan::ClusterSpec* cl = in.cluster;
  Picture pic;

  size_t total = 0;
  for (const auto& pl : plan.pipelines) total += pl.stages.size();
  int64_t blocks = in.num_layers;
  if (blocks <= 0)
    for (const auto& pl : plan.pipelines)
      if (!pl.stages.empty()) blocks = std::max(blocks, pl.stages.back().layer_end);

  std::vector<std::string> problems;
  const json& pred = in.predicted.is_null() ? plan.predicted : in.predicted;
  std::vector<json> times = per_stage(pred, "per_stage", plan, total, problems);
  std::vector<json> memory = per_stage(pred, "memory_bytes", plan, total, problems);

  // Groups: hosts in the cluster's order, or pipelines.
  std::map<std::string, int> host_group;
  if (cl) {
    for (const auto& h : cl->hosts()) {
      host_group[h] = static_cast<int>(pic.groups.size());
      pic.groups.push_back({"h" + std::to_string(pic.groups.size()), {"host " + h}, h});
    }
  } else {
    for (size_t p = 0; p < plan.pipelines.size(); ++p) {
      const auto& pl = plan.pipelines[p];
      pic.groups.push_back({"p" + std::to_string(p),
                            {"pipeline " + std::to_string(p), micro_batches_text(pl) + " = " + std::to_string(pl.samples())},
                            ""});
    }
  }
  int unplaced = -1;
  std::set<int> used_devices;
  std::set<std::string> hosts_named;  // hosts some stage names instead of a device

  std::vector<std::vector<int>> node_of(plan.pipelines.size());  // [pipeline][stage] -> node
  size_t k = 0;
  for (size_t p = 0; p < plan.pipelines.size(); ++p) {
    const auto& pl = plan.pipelines[p];
    for (size_t s = 0; s < pl.stages.size(); ++s, ++k) {
      const auto& st = pl.stages[s];
      Node n;
      n.id = "s" + std::to_string(p) + "_" + std::to_string(s);
      n.pipeline = static_cast<int>(p);
      n.lines.push_back(ranks_heading(st.ranks));
      if (st.ranks.size() > 1) {
        // A tensor-parallel group: its heads per rank, and every member's device.
        std::string heads, names;
        for (size_t k2 = 0; k2 < st.tp_split.size(); ++k2) heads += (k2 ? ":" : "") + std::to_string(st.tp_split[k2]);
        for (size_t k2 = 0; k2 < st.devices.size(); ++k2) names += (k2 ? " + " : "") + st.devices[k2];
        n.lines.push_back("tensor parallel x" + std::to_string(st.ranks.size()) + (heads.empty() ? " (even heads)" : ", heads " + heads) +
                          (names.empty() ? "" : ": " + names));
      }
      if (cl) {
        n.lines.push_back("pipeline " + std::to_string(p) + ", stage " + std::to_string(s));
        int d = st.device.empty() ? -1 : cl->device_index(st.device);
        if (d >= 0) {
          const auto& dev = cl->devices[static_cast<size_t>(d)];
          used_devices.insert(d);
          for (const auto& member : st.devices)  // a tensor-parallel group's other members are used too
            if (const int m = cl->device_index(member); m >= 0) used_devices.insert(m);
          n.group = host_group.at(dev.host);
          std::string kind = dev.type.empty() || dev.type == dev.kind ? dev.kind : dev.type + ", " + dev.kind;
          n.lines.push_back(dev.name + " (" + kind + ")");
        } else if (!st.device.empty() && host_group.count(st.device)) {
          // Plans converted from hetero_config.json name the worker's host, not a device.
          hosts_named.insert(st.device);
          n.group = host_group.at(st.device);
          // Which kind, where the file says (num_gpus processes of one kind on the machine).
          std::set<std::string> kinds;
          int count = 0;
          for (const auto& dev : cl->devices)
            if (dev.host == st.device) kinds.insert(dev.kind), ++count;
          const std::string kind = kinds.size() == 1 ? *kinds.begin() + " " : "";
          n.lines.push_back((count > 1 ? "one of " + std::to_string(count) + " " + kind + "devices" : "a " + kind + "device") +
                            " of host " + st.device);
        } else {
          if (unplaced < 0) {
            unplaced = static_cast<int>(pic.groups.size());
            pic.groups.push_back({"u", {"not in the cluster" + (cl->name.empty() ? "" : " " + cl->name)}, ""});
          }
          n.group = unplaced;
          n.lines.push_back(st.device.empty() ? "no device named" : st.device + " (unknown device)");
        }
      } else {
        n.group = static_cast<int>(p);
        if (!st.device.empty()) n.lines.push_back(st.device);
      }
      bool head = in.num_layers > 0 ? st.unit_end() == 2 * in.num_layers : s + 1 == pl.stages.size();
      n.lines.push_back("blocks " + range(st.unit_begin(), st.unit_end()) + (st.unit_begin() == 0 ? " + embedding" : "") +
                        (head ? " + head" : ""));
      if (st.floats())
        n.lines.push_back("last half block in " + std::to_string(pl.float_count(s)) + " of " + std::to_string(pl.num_micro_batches) +
                          " micro-batches");
      if (st.cuts_mlp()) n.lines.push_back("last MLP: columns of " + std::to_string(st.mlp_cut) + " heads");
      if (s > 0 && pl.stages[s - 1].cuts_mlp()) n.lines.push_back("first MLP: the other columns");
      n.lines.push_back(micro_batches_text(pl));
      for (const json* v : {&times[k], &memory[k]}) {
        std::string t = predicted_text(*v, v == &memory[k]);
        if (!t.empty()) n.lines.push_back(t);
      }
      node_of[p].push_back(static_cast<int>(pic.nodes.size()));
      pic.nodes.push_back(n);
    }
    if (in.num_layers > 0 && !pl.stages.empty() && pl.stages.back().unit_end() != 2 * in.num_layers)
      problems.push_back("pipeline " + std::to_string(p) + " ends at block " + std::to_string(pl.stages.back().unit_end() / 2) +
                         (pl.stages.back().unit_end() % 2 ? ".5" : "") +
                         ", the model has " + std::to_string(in.num_layers));
  }
  if (cl) {
    for (size_t d = 0; d < cl->devices.size(); ++d) {
      const auto& dev = cl->devices[d];
      if (used_devices.count(static_cast<int>(d)) || hosts_named.count(dev.host)) continue;
      Node n;
      n.id = "d" + std::to_string(d);
      n.group = host_group.at(dev.host);
      n.lines = {dev.name, dev.type.empty() ? dev.kind : dev.type + ", " + dev.kind, "unused"};
      pic.nodes.push_back(n);
    }
  }

  // Activations: stage to stage within each pipeline.
  for (const auto& nodes : node_of)
    for (size_t s = 1; s < nodes.size(); ++s) pic.activations.push_back({nodes[s - 1], nodes[s], ""});
  // Gradient sync: stages of consecutive pipelines sharing blocks. Every pipeline covers every
  // block, so this chain reaches every rank of every sync group.
  for (size_t p = 1; p < plan.pipelines.size(); ++p)
    for (size_t a = 0; a < plan.pipelines[p - 1].stages.size(); ++a)
      for (size_t b = 0; b < plan.pipelines[p].stages.size(); ++b) {
        const auto& sa = plan.pipelines[p - 1].stages[a];
        const auto& sb = plan.pipelines[p].stages[b];
        int64_t lo = std::max(sa.unit_begin(), sb.unit_begin()), hi = std::min(sa.unit_end(), sb.unit_end());
        if (lo < hi) pic.syncs.push_back({node_of[p - 1][a], node_of[p][b], "sync " + range(lo, hi)});
      }

  // Network links: only host pairs an edge above crosses.
  if (cl) {
    std::set<std::pair<int, int>> pairs;
    std::set<int> inside;
    for (const auto* edges : {&pic.activations, &pic.syncs})
      for (const auto& e : *edges) {
        int ga = pic.nodes[static_cast<size_t>(e.from)].group, gb = pic.nodes[static_cast<size_t>(e.to)].group;
        if (ga == unplaced || gb == unplaced) continue;
        if (ga == gb)
          inside.insert(ga);
        else
          pairs.insert({std::min(ga, gb), std::max(ga, gb)});
      }
    auto host = [&](int g) { return pic.groups[static_cast<size_t>(g)].host; };
    // A file that describes no network: its links are the planner's assumption, and say so.
    auto label = [&](const std::string& a, const std::string& b) {
      return link_label(cl->link(a, b)) + (cl->links_described ? "" : " (assumed: " + (cl->name.empty() ? std::string("the file") : cl->name) +
                                                                          " gives no network)");
    };
    for (const auto& [a, b] : pairs) pic.links.push_back({a, b, label(host(a), host(b))});
    for (int g : inside) pic.groups[static_cast<size_t>(g)].lines.push_back("within: " + label(host(g), host(g)));
  }

  // The note: what this is, who syncs what, how to read it.
  pic.note.push_back("Alloy plan: " + std::to_string(plan.world_size()) + " ranks in " +
                     std::to_string(plan.pipelines.size()) + (plan.pipelines.size() == 1 ? " pipeline" : " pipelines") +
                     ", " + std::to_string(blocks) + " blocks, schedule " + plan.schedules_text() + ", global batch " +
                     std::to_string(plan.global_batch) + (cl && !cl->name.empty() ? ", cluster " + cl->name : ""));
  if (pred.is_object() && pred.contains("step_s") && pred["step_s"].is_number())
    pic.note.push_back("predicted step time " + seconds(pred["step_s"].get<double>()));
  // Sync groups: block ranges with the same holders, found between consecutive stage boundaries.
  std::set<int64_t> cuts;
  for (const auto& pl : plan.pipelines)
    for (const auto& st : pl.stages) {
      cuts.insert(st.unit_begin());
      cuts.insert(st.unit_end());
    }
  std::vector<int64_t> bounds(cuts.begin(), cuts.end());
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<int>>> groups;  // [lo, hi) -> ranks
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    std::vector<int> ranks;
    for (const auto& pl : plan.pipelines)
      for (const auto& st : pl.stages)
        if (st.unit_begin() <= bounds[i] && bounds[i + 1] <= st.unit_end()) ranks.insert(ranks.end(), st.ranks.begin(), st.ranks.end());
    std::sort(ranks.begin(), ranks.end());
    if (!groups.empty() && groups.back().second == ranks && groups.back().first.second == bounds[i])
      groups.back().first.second = bounds[i + 1];
    else
      groups.push_back({{bounds[i], bounds[i + 1]}, ranks});
  }
  bool any_sync = false;
  for (const auto& [r, ranks] : groups) {
    if (ranks.size() < 2) continue;
    any_sync = true;
    pic.note.push_back("gradient sync, blocks " + range(r.first, r.second) + (r.first == 0 ? " + embedding" : "") +
                       (r.second == 2 * blocks ? " + head" : "") + ": ranks " + rank_list(ranks));
  }
  if (!any_sync) pic.note.push_back("no gradient sync between ranks (no block is held twice)");
  // Repeated in the note because in a dense picture a label can sit nearer another host's bar.
  for (const auto& l : pic.links)
    pic.note.push_back("network link " + pic.groups[static_cast<size_t>(l.a)].host + " - " +
                       pic.groups[static_cast<size_t>(l.b)].host + ": " + l.label);
  std::string legend = "arrows: activations (gradients flow back); colour: pipeline";
  if (!pic.syncs.empty()) legend += "; dashed: gradient sync";
  if (!pic.links.empty()) legend += "; grey bars: network links used";
  pic.note.push_back(legend);
  for (const auto& p : problems) pic.note.push_back("note: " + p);
  return pic;
}

// ---- escaping ----

// Control characters would end a DOT string or a Mermaid statement early.
char printable(char c) { return (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? ' ' : c; }

// Inside a DOT double-quoted string the lexer only knows \" , and Graphviz's label expansion
// gives backslash sequences (\n, \N, \G, ...) meaning, so a literal backslash is doubled.
std::string dot_str(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += printable(c);
  }
  return o;
}

// Text inside a DOT HTML-like label is XML, and Graphviz still expands \N, \G, ... in it after
// decoding entities, so a backslash is doubled as in quoted strings.
std::string dot_html(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '\\': o += "\\\\"; break;
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += printable(c);
    }
  }
  return o;
}

// Mermaid decodes #name; and #number; entities in quoted labels; quotes, markup and the
// characters that delimit its own syntax are written that way.
std::string mmd(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '"': o += "#quot;"; break;
      case '#': o += "#35;"; break;
      case '&': o += "#amp;"; break;
      case '<': o += "#lt;"; break;
      case '>': o += "#gt;"; break;
      case '|': o += "#124;"; break;
      case '`': o += "#96;"; break;
      default: o += printable(c);
    }
  }
  return o;
}

// ---- writers ----

std::string dot_node_label(const Node& n) {
  std::string l = "<<b>" + dot_html(n.lines[0]) + "</b>";
  for (size_t i = 1; i < n.lines.size(); ++i) l += "<br/>" + dot_html(n.lines[i]);
  return l + ">";
}

std::string mmd_label(const std::vector<std::string>& lines, bool bold_first) {
  std::string l;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) l += "<br/>";
    l += (i == 0 && bold_first) ? "<b>" + mmd(lines[i]) + "</b>" : mmd(lines[i]);
  }
  return "\"" + l + "\"";
}

}  // namespace

std::string to_dot(const DiagramInput& in) {
  Picture pic = build(in);
  std::ostringstream o;
  o << "digraph alloy_plan {\n";
  std::string note;
  for (const auto& l : pic.note) note += dot_str(l) + "\\l";
  o << "  graph [rankdir=LR, compound=true, fontname=\"Helvetica\", fontsize=11, labelloc=t, labeljust=l, "
       "nodesep=0.35, ranksep=1.2, pad=0.2, label=\""
    << note << "\"];\n";
  o << "  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10, margin=\"0.15,0.07\"];\n";
  o << "  edge [fontname=\"Helvetica\", fontsize=9];\n";
  for (size_t g = 0; g < pic.groups.size(); ++g) {
    const Group& gr = pic.groups[g];
    std::string label;
    for (const auto& l : gr.lines) label += dot_str(l) + "\\l";
    o << "  subgraph cluster_" << gr.id << " {\n";
    o << "    label=\"" << label << "\"; style=\"rounded" << (gr.id == "u" ? ",dashed" : "")
      << "\"; color=\"#4a6fa5\"; fontcolor=\"#23395d\"; fontsize=11;\n";
    // Host links attach to this invisible point and are clipped at the box (compound=true); a
    // stage node as the end would lay the bar over the activation or sync edge between them.
    if (!gr.host.empty()) o << "    " << gr.id << "_anchor [shape=point, style=invis, width=0.01, height=0.01, label=\"\"];\n";
    for (const auto& n : pic.nodes) {
      if (n.group != static_cast<int>(g)) continue;
      o << "    " << n.id << " [label=" << dot_node_label(n);
      if (n.pipeline >= 0)
        o << ", fillcolor=\"" << pipeline_fill(n.pipeline) << "\"";
      else
        o << ", style=\"rounded,dashed,filled\", fillcolor=\"#f4f4f4\", color=\"#999999\", fontcolor=\"#777777\"";
      o << "];\n";
    }
    o << "  }\n";
  }
  for (const auto& e : pic.activations)
    o << "  " << pic.nodes[static_cast<size_t>(e.from)].id << " -> " << pic.nodes[static_cast<size_t>(e.to)].id
      << " [color=\"#333333\", penwidth=1.4];\n";
  // Sync and link edges are placed without ranking constraints, so they often join nodes of one
  // rank column ("flat" edges); Graphviz 2.42 frees memory twice in gvFreeLayout after laying
  // out flat edges that have a `label`, hence `xlabel`, which is placed after layout.
  for (const auto& e : pic.syncs)
    o << "  " << pic.nodes[static_cast<size_t>(e.from)].id << " -> " << pic.nodes[static_cast<size_t>(e.to)].id
      << " [style=dashed, dir=none, constraint=false, color=\"#b5651d\", fontcolor=\"#8a4a12\", xlabel=\"" << dot_str(e.label)
      << "\"];\n";
  for (const auto& l : pic.links) {
    const auto& a = pic.groups[static_cast<size_t>(l.a)].id;
    const auto& b = pic.groups[static_cast<size_t>(l.b)].id;
    o << "  " << a << "_anchor -> " << b << "_anchor [ltail=cluster_" << a << ", lhead=cluster_" << b
      << ", dir=none, constraint=false, penwidth=5, color=\"#a9a9a9\", fontcolor=\"#444444\", fontsize=10, xlabel=\""
      << dot_str(l.label) << "\"];\n";
  }
  o << "}\n";
  return o.str();
}

std::string to_mermaid(const DiagramInput& in) {
  Picture pic = build(in);
  std::ostringstream o;
  for (const auto& l : pic.note) {
    std::string line;
    for (char c : l) line += printable(c);
    o << "%% " << line << "\n";
  }
  o << "flowchart LR\n";
  o << "  legend[" << mmd_label(pic.note, true) << "]\n";
  for (size_t g = 0; g < pic.groups.size(); ++g) {
    const Group& gr = pic.groups[g];
    o << "  subgraph " << gr.id << "[" << mmd_label(gr.lines, false) << "]\n";
    for (const auto& n : pic.nodes)
      if (n.group == static_cast<int>(g)) o << "    " << n.id << "[" << mmd_label(n.lines, true) << "]\n";
    o << "  end\n";
  }
  for (const auto& e : pic.activations)
    o << "  " << pic.nodes[static_cast<size_t>(e.from)].id << " --> " << pic.nodes[static_cast<size_t>(e.to)].id << "\n";
  for (const auto& e : pic.syncs)
    o << "  " << pic.nodes[static_cast<size_t>(e.from)].id << " -.-|" << mmd_label({e.label}, false) << "| "
      << pic.nodes[static_cast<size_t>(e.to)].id << "\n";
  for (const auto& l : pic.links)
    o << "  " << pic.groups[static_cast<size_t>(l.a)].id << " ===|" << mmd_label({l.label}, false) << "| "
      << pic.groups[static_cast<size_t>(l.b)].id << "\n";
  o << "  classDef notebox fill:#fffbe6,stroke:#d6c48a,color:#333\n";
  o << "  classDef idle fill:#f4f4f4,stroke:#999,stroke-dasharray:4 3,color:#777\n";
  o << "  class legend notebox\n";
  std::map<int, std::vector<std::string>> by_pipeline;
  std::vector<std::string> idle;
  for (const auto& n : pic.nodes) (n.pipeline >= 0 ? by_pipeline[n.pipeline] : idle).push_back(n.id);
  auto join = [](const std::vector<std::string>& ids) {
    std::string s;
    for (const auto& id : ids) s += (s.empty() ? "" : ",") + id;
    return s;
  };
  for (const auto& [p, ids] : by_pipeline) {
    o << "  classDef p" << p << " fill:" << pipeline_fill(p) << ",stroke:#4a6fa5,color:#111\n";
    o << "  class " << join(ids) << " p" << p << "\n";
  }
  if (!idle.empty()) o << "  class " << join(idle) << " idle\n";
  size_t link_index = pic.activations.size() + pic.syncs.size();
  for (size_t i = 0; i < pic.links.size(); ++i)
    o << "  linkStyle " << link_index + i << " stroke:#a9a9a9,stroke-width:5px\n";
  return o.str();
}

#if ALLOY_HAVE_GRAPHVIZ
namespace {

std::mutex g_gv_mutex;
std::string* g_gv_messages = nullptr;  // guarded by g_gv_mutex

int collect_gv_message(char* msg) {
  if (g_gv_messages && msg) *g_gv_messages += msg;
  return 0;
}

// Graphviz repeats a message for every label it affects; one of each is enough.
std::string tidy(const std::string& messages) {
  std::vector<std::string> seen;
  std::istringstream in(messages);
  for (std::string line; std::getline(in, line);) {
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
    if (!line.empty() && std::find(seen.begin(), seen.end(), line) == seen.end()) seen.push_back(line);
  }
  std::string out;
  for (const auto& l : seen) out += (out.empty() ? "" : "; ") + l;
  return out;
}

// Lays out DOT and renders it in FORMAT ("svg", "png", "pdf") in memory. Graphviz keeps global
// state (error hooks, the shared context), hence one render at a time.
std::string render(const std::string& dot, const std::string& format, const std::string& file) {
  std::lock_guard<std::mutex> lock(g_gv_mutex);
  std::string messages;
  g_gv_messages = &messages;
  struct Hook {
    agusererrf prev;
    ~Hook() {
      agseterrf(prev);
      g_gv_messages = nullptr;
    }
  } hook{agseterrf(collect_gv_message)};

  // One context for the process, never freed: Graphviz 2.42's pango plugin keeps a pointer to the
  // last font name, which lives in the context, and reads it in the next context after
  // gvFreeContext has freed it. Loading the plugin configuration once is cheaper, too.
  static GVC_t* const gvc = gvContext();
  if (!gvc) throw Error(file + ": cannot start Graphviz (gvContext failed)");

  Agraph_t* g = agmemread(dot.c_str());
  if (!g) throw Error(file + ": Graphviz rejected the generated DOT: " + tidy(messages));
  struct Graph {
    GVC_t* gvc;
    Agraph_t* g;
    bool laid_out = false;
    ~Graph() {
      if (laid_out) gvFreeLayout(gvc, g);
      agclose(g);
    }
  } graph{gvc, g};
  if (gvLayout(gvc, g, "dot") != 0)
    throw Error(file + ": Graphviz could not lay out the diagram (is its dot layout plugin installed?): " + tidy(messages));
  graph.laid_out = true;

  char* data = nullptr;
  unsigned int length = 0;
  int rc = gvRenderData(gvc, g, format.c_str(), &data, &length);
  if (rc != 0 && format == "png") {
    // PNG comes from the cairo plugin where it is installed; the gd plugin also writes PNG.
    if (data) gvFreeRenderData(data);
    data = nullptr;
    std::string first = tidy(messages);
    messages.clear();
    rc = gvRenderData(gvc, g, "png:gd", &data, &length);
    if (rc != 0) messages = first + "\npng:gd: " + tidy(messages);
  }
  if (rc != 0 || !data) {
    if (data) gvFreeRenderData(data);
    throw Error(file + ": Graphviz cannot render " + format + " on this machine (" + format +
                " comes from its cairo plugin, libgvplugin_pango in Debian's libgvc6" +
                (format == "png" ? ", or its gd plugin" : "") + "): " + tidy(messages));
  }
  std::string out(data, length);
  gvFreeRenderData(data);
  if (!tidy(messages).empty()) log_warn(file + ": Graphviz: " + tidy(messages));
  return out;
}

}  // namespace

bool diagram_renders() { return true; }
std::string diagram_formats() { return ".svg, .png, .pdf, .dot, .mmd"; }
#else
namespace {
std::string render(const std::string&, const std::string& format, const std::string& file) {
  throw InputError(file, "this alloy was built without Graphviz (-DALLOY_GRAPHVIZ=OFF), so it cannot render ." + format +
                             "; write .dot and render it with `dot -T" + format + "`, or write .mmd");
}
}  // namespace

bool diagram_renders() { return false; }
std::string diagram_formats() { return ".dot, .mmd (.svg, .png and .pdf need a build with Graphviz)"; }
#endif

void write_diagram(const DiagramInput& in, const std::string& file) {
  size_t slash = file.find_last_of('/');
  size_t dot = file.find_last_of('.');
  std::string ext;
  if (dot != std::string::npos && (slash == std::string::npos || dot > slash)) ext = file.substr(dot + 1);
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::string content;
  if (ext == "svg" || ext == "png" || ext == "pdf")
    content = render(to_dot(in), ext, file);
  else if (ext == "dot")
    content = to_dot(in);
  else if (ext == "mmd")
    content = to_mermaid(in);
  else
    throw InputError(file, (ext.empty() ? std::string("no file extension") : "unknown diagram format '." + ext + "'") +
                               "; use one of " + diagram_formats());
  write_file_atomic(file, content);
}

}  // namespace alloy::viz
