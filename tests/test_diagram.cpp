#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <string>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/plan.h"
#include "alloy/plan/cluster.h"
#include "alloy/viz/diagram.h"

using alloy::PipelinePlan;
using alloy::Plan;
using alloy::StagePlan;
using alloy::plan::ClusterSpec;
using alloy::plan::Device;
using alloy::plan::Link;
using alloy::plan::LinkRule;
using alloy::viz::DiagramInput;

namespace {

// Pipeline 0: rank 0 on "fast" (host h0) holds [0,6), rank 1 on "slow" (h2) holds [6,8).
// Pipeline 1: rank 2 on "mid" (h1) holds all 8 blocks. So activations cross h0-h2 and gradient
// sync crosses h0-h1 and h1-h2; host h3 only has an idle device and must get no link.
Plan sample_plan() {
  Plan p;
  p.global_batch = 32;
  PipelinePlan a;
  a.micro_batch_size = 6;
  a.num_micro_batches = 4;
  a.stages = {StagePlan{{0}, 0, 6, "fast"}, StagePlan{{1}, 6, 8, "slow"}};
  PipelinePlan b;
  b.micro_batch_size = 2;
  b.num_micro_batches = 4;
  b.stages = {StagePlan{{2}, 0, 8, "mid"}};
  p.pipelines = {a, b};
  return p;
}

ClusterSpec sample_cluster() {
  ClusterSpec c;
  c.name = "three-hosts";
  c.devices = {Device{"fast", "h0", "cpu", "cpu-full", 8, 1.0, 0}, Device{"mid", "h1", "cpu", "cpu-half", 8, 0.5, 0},
               Device{"slow", "h2", "cpu", "cpu-quarter", 8, 0.25, 0}, Device{"spare", "h3", "cuda", "T4", 16, 1.0, 0}};
  c.rules = {LinkRule{"h0", "h2", Link{0.1, 0.2}}, LinkRule{"h0", "h1", Link{10, 0.05}},
             LinkRule{"h0", "h3", Link{40, 0.01}}};
  c.default_link = Link{1, 0.5};
  return c;
}

std::string temp_dir() {
  std::string t = (std::filesystem::temp_directory_path() / "alloy_diagram_XXXXXX").string();
  if (!mkdtemp(t.data())) throw std::runtime_error("mkdtemp failed");
  return t;
}

bool contains(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

struct Fixture : ::testing::Test {
  Plan plan = sample_plan();
  ClusterSpec cluster = sample_cluster();
  DiagramInput in{&plan, &cluster, 8, nullptr};
  std::string dir = temp_dir();
  ~Fixture() override { std::filesystem::remove_all(dir); }
};

TEST_F(Fixture, DotShowsStagesHostsAndUsedLinksOnly) {
  std::string d = alloy::viz::to_dot(in);
  for (const char* s : {"rank 0", "rank 1", "rank 2", "host h0", "host h1", "host h2", "host h3", "fast (cpu-full, cpu)",
                        "slow (cpu-quarter, cpu)", "blocks [0, 6) + embedding", "blocks [6, 8) + head",
                        "blocks [0, 8) + embedding + head", "6 samples x 4 micro-batches", "2 samples x 4 micro-batches",
                        "sync [0, 6)", "sync [6, 8)", "unused"})
    EXPECT_TRUE(contains(d, s)) << s << "\n" << d;
  // One cluster box per host.
  for (const char* s : {"subgraph cluster_h0", "subgraph cluster_h1", "subgraph cluster_h2", "subgraph cluster_h3"})
    EXPECT_TRUE(contains(d, s)) << s;
  // Links: h0-h2 (activations), h0-h1 and h1-h2 (sync, the latter on the default link).
  EXPECT_TRUE(contains(d, "ltail=cluster_h0, lhead=cluster_h2")) << d;
  EXPECT_TRUE(contains(d, "label=\"0.1 Gbit/s, 0.2 ms\"")) << d;
  EXPECT_TRUE(contains(d, "ltail=cluster_h0, lhead=cluster_h1")) << d;
  EXPECT_TRUE(contains(d, "label=\"10 Gbit/s, 0.05 ms\"")) << d;
  EXPECT_TRUE(contains(d, "ltail=cluster_h1, lhead=cluster_h2")) << d;
  EXPECT_TRUE(contains(d, "label=\"1 Gbit/s, 0.5 ms\"")) << d;
  // h3 exchanges nothing, so its 40 Gbit/s link is not drawn.
  EXPECT_FALSE(contains(d, "40 Gbit/s")) << d;
  EXPECT_FALSE(contains(d, "cluster_h3,")) << d;
  EXPECT_TRUE(contains(d, "gradient sync, blocks [0, 6) + embedding: ranks 0, 2")) << d;
  EXPECT_TRUE(contains(d, "gradient sync, blocks [6, 8) + head: ranks 1, 2")) << d;
}

TEST_F(Fixture, MermaidShowsStagesHostsAndLinks) {
  std::string m = alloy::viz::to_mermaid(in);
  EXPECT_EQ(m.rfind("%% ", 0), 0u) << m;
  EXPECT_TRUE(contains(m, "\nflowchart LR\n")) << m;
  for (const char* s : {"<b>rank 0</b>", "<b>rank 1</b>", "<b>rank 2</b>", "subgraph h0[\"host h0\"]",
                        "subgraph h1[\"host h1", "subgraph h2[\"host h2\"]", "subgraph h3[\"host h3\"]",
                        "blocks [0, 6) + embedding", "blocks [6, 8) + head", "6 samples x 4 micro-batches",
                        "s0_0 --> s0_1", "s0_0 -.-|\"sync [0, 6)\"| s1_0", "h0 ===|\"0.1 Gbit/s, 0.2 ms\"| h2",
                        "h0 ===|\"10 Gbit/s, 0.05 ms\"| h1", "h1 ===|\"1 Gbit/s, 0.5 ms\"| h2"})
    EXPECT_TRUE(contains(m, s)) << s << "\n" << m;
  EXPECT_FALSE(contains(m, "40 Gbit/s")) << m;
  // Every subgraph is closed.
  size_t opened = 0, closed = 0;
  for (size_t i = m.find("subgraph "); i != std::string::npos; i = m.find("subgraph ", i + 1)) ++opened;
  for (size_t i = m.find("\n  end\n"); i != std::string::npos; i = m.find("\n  end\n", i + 1)) ++closed;
  EXPECT_EQ(opened, 4u);
  EXPECT_EQ(closed, opened);
}

TEST_F(Fixture, WithoutClusterGroupsByPipeline) {
  in.cluster = nullptr;
  std::string d = alloy::viz::to_dot(in);
  EXPECT_TRUE(contains(d, "subgraph cluster_p0")) << d;
  EXPECT_TRUE(contains(d, "subgraph cluster_p1")) << d;
  EXPECT_TRUE(contains(d, "pipeline 0\\l6 samples x 4 micro-batches = 24")) << d;
  EXPECT_FALSE(contains(d, "Gbit/s")) << d;
  EXPECT_FALSE(contains(d, "host ")) << d;
  std::string m = alloy::viz::to_mermaid(in);
  EXPECT_TRUE(contains(m, "subgraph p0[\"pipeline 0<br/>6 samples x 4 micro-batches = 24\"]")) << m;
  EXPECT_TRUE(contains(m, "subgraph p1[")) << m;
}

TEST_F(Fixture, StagesNamingHostsOrUnknownDevicesArePlacedHonestly) {
  // hetero_config.json conversions name the worker's host; a typo names nothing.
  plan.pipelines[0].stages[1].device = "h2";
  plan.pipelines[1].stages[0].device = "gpu-typo";
  std::string d = alloy::viz::to_dot(in);
  EXPECT_TRUE(contains(d, "a cpu device of host h2")) << d;
  EXPECT_TRUE(contains(d, "subgraph cluster_u")) << d;
  EXPECT_TRUE(contains(d, "gpu-typo (unknown device)")) << d;
  EXPECT_TRUE(contains(d, "0.1 Gbit/s")) << d;
  // Rank 2's host is unknown, so no sync link can be named for it.
  EXPECT_FALSE(contains(d, "10 Gbit/s")) << d;
}

// HeteroShard's diagram shows each stage's device and the network between machines. A
// hetero_config.json names the machines and their devices but no links: the stage says its kind of
// device, and the link between hosts says it is assumed, not given.
TEST_F(Fixture, AFileWithoutANetworkSaysItsLinksAreAssumed) {
  ClusterSpec hosts;
  hosts.name = "hetero_config";
  hosts.devices = {Device{"mac-0", "mac", "cpu", "cpu", 0, 1.0, 0}, Device{"gpu-box-0", "gpu-box", "cuda", "cuda", 0, 1.0, 0},
                   Device{"gpu-box-1", "gpu-box", "cuda", "cuda", 0, 1.0, 0}};
  hosts.links_described = false;
  Plan p;
  p.global_batch = 8;
  PipelinePlan pl;
  pl.micro_batch_size = 2;
  pl.num_micro_batches = 4;
  pl.stages = {StagePlan{{0}, 0, 2, "mac"}, StagePlan{{1}, 2, 6, "gpu-box"}, StagePlan{{2}, 6, 8, "gpu-box"}};
  p.pipelines = {pl};
  const std::string d = alloy::viz::to_mermaid({&p, &hosts, 8, nullptr});
  EXPECT_TRUE(contains(d, "a cpu device of host mac")) << d;
  EXPECT_TRUE(contains(d, "one of 2 cuda devices of host gpu-box")) << d;
  EXPECT_TRUE(contains(d, "network link mac - gpu-box: 1 Gbit/s, 0.1 ms (assumed: hetero_config gives no network)")) << d;
  EXPECT_TRUE(contains(d, "within: ")) << d;  // ranks 1 and 2 share gpu-box
  // A described network is shown as given.
  hosts.links_described = true;
  EXPECT_FALSE(contains(alloy::viz::to_mermaid({&p, &hosts, 8, nullptr}), "assumed")) ;
}

TEST_F(Fixture, PredictedFiguresAnnotateStages) {
  in.predicted = {{"step_s", 1.25},
                  {"per_stage", {{{"compute_s", 0.5}, {"p2p_s", 0.02}}, 0.75, 1.5}},
                  {"memory_bytes", {{"0", 1.5 * 1024 * 1024 * 1024}}}};
  std::string d = alloy::viz::to_dot(in);
  EXPECT_TRUE(contains(d, "predicted step time 1.25 s")) << d;
  EXPECT_TRUE(contains(d, "predicted compute 0.5 s, p2p 20 ms")) << d;
  EXPECT_TRUE(contains(d, "predicted 0.75 s")) << d;
  EXPECT_TRUE(contains(d, "memory 1.5 GiB")) << d;
  // Without an explicit prediction, the plan's own is used; a wrong shape is reported, not drawn.
  in.predicted = nullptr;
  plan.predicted = {{"per_stage", {1, 2}}};
  d = alloy::viz::to_dot(in);
  EXPECT_TRUE(contains(d, "predicted.per_stage has 2 entries for 3 stages; not shown")) << d;
  EXPECT_FALSE(contains(d, "predicted 1 s")) << d;
}

// A build without Graphviz (-DALLOY_GRAPHVIZ=OFF) must refuse to render, name the file, say how
// to render the DOT instead, and leave nothing behind. True when this build renders.
bool renders_or_refuses(const DiagramInput& in, const std::string& path) {
  if (alloy::viz::diagram_renders()) return true;
  try {
    alloy::viz::write_diagram(in, path);
    ADD_FAILURE() << path << " was written by a build without Graphviz";
  } catch (const alloy::InputError& e) {
    EXPECT_TRUE(contains(e.what(), path)) << e.what();
    EXPECT_TRUE(contains(e.what(), "dot -T")) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  return false;
}

TEST_F(Fixture, LabelsAreEscaped) {
  cluster.devices[0].name = "gpu \"A\" <x> & \\N|#`";
  plan.pipelines[0].stages[0].device = cluster.devices[0].name;
  std::string d = alloy::viz::to_dot(in);
  EXPECT_TRUE(contains(d, "gpu &quot;A&quot; &lt;x&gt; &amp; \\\\N|#`")) << d;  // HTML-like node label
  cluster.name = "c\"1\\";
  d = alloy::viz::to_dot(in);
  EXPECT_TRUE(contains(d, "cluster c\\\"1\\\\")) << d;  // quoted graph label
  std::string m = alloy::viz::to_mermaid(in);
  EXPECT_TRUE(contains(m, "gpu #quot;A#quot; #lt;x#gt; #amp; \\N#124;#35;#96;")) << m;
  EXPECT_FALSE(contains(m, "<x>")) << m;

  // Graphviz must still parse and render it, showing the text as written.
  std::string svg_path = dir + "/escaped.svg";
  if (!renders_or_refuses(in, svg_path)) return;
  alloy::viz::write_diagram(in, svg_path);
  std::string svg = alloy::read_file(svg_path);
  EXPECT_TRUE(contains(svg, "gpu &quot;A&quot; &lt;x&gt; &amp; \\N|#`")) << svg;
  EXPECT_TRUE(contains(svg, "cluster c&quot;1\\")) << svg;
}

TEST_F(Fixture, WritesSvg) {
  std::string path = dir + "/plan.svg";
  if (!renders_or_refuses(in, path)) return;
  alloy::viz::write_diagram(in, path);
  std::string svg = alloy::read_file(path);
  EXPECT_TRUE(svg.rfind("<?xml", 0) == 0 || svg.rfind("<svg", 0) == 0) << svg.substr(0, 200);
  EXPECT_TRUE(contains(svg, "</svg>"));
  EXPECT_TRUE(contains(svg, "rank 1"));
  EXPECT_TRUE(contains(svg, "0.1 Gbit/s, 0.2 ms"));
  EXPECT_TRUE(contains(svg, "host h2"));
}

TEST_F(Fixture, WritesPngAndPdf) {
  std::string png_path = dir + "/plan.PNG";  // extensions are case-insensitive
  const bool png_ok = renders_or_refuses(in, png_path), pdf_ok = renders_or_refuses(in, dir + "/plan.pdf");
  if (!png_ok || !pdf_ok) return;
  alloy::viz::write_diagram(in, png_path);
  std::string png = alloy::read_file(png_path);
  ASSERT_GT(png.size(), 1000u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  std::string pdf_path = dir + "/plan.pdf";
  alloy::viz::write_diagram(in, pdf_path);
  EXPECT_EQ(alloy::read_file(pdf_path).substr(0, 5), "%PDF-");
  // Nothing but the results is left behind.
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 2u);
}

TEST_F(Fixture, WritesMermaidAndDotText) {
  alloy::viz::write_diagram(in, dir + "/plan.mmd");
  EXPECT_EQ(alloy::read_file(dir + "/plan.mmd"), alloy::viz::to_mermaid(in));
  alloy::viz::write_diagram(in, dir + "/plan.dot");
  EXPECT_EQ(alloy::read_file(dir + "/plan.dot"), alloy::viz::to_dot(in));
}

TEST_F(Fixture, UnknownExtensionNamesTheValidOnes) {
  for (const std::string name : {"plan.jpg", "plan", "dir.d/plan"}) {
    try {
      alloy::viz::write_diagram(in, dir + "/" + name);
      FAIL() << name << " was accepted";
    } catch (const alloy::InputError& e) {
      std::string msg = e.what();
      EXPECT_TRUE(contains(msg, name)) << msg;
      EXPECT_TRUE(contains(msg, alloy::viz::diagram_renders() ? ".svg, .png, .pdf, .dot, .mmd" : ".dot, .mmd")) << msg;
    }
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/plan.jpg"));
}

// Three pipelines of different depths over four hosts: several sync and link edges join nodes of
// one rank column. Graphviz 2.42 frees memory twice after laying out such "flat" edges when they
// carry a `label`, so the diagram labels them with `xlabel`; this render used to abort.
TEST(Diagram, RendersDensePlanWithoutFlatEdgeLabels) {
  Plan p;
  p.global_batch = 64;
  PipelinePlan a{4, 8, {StagePlan{{0}, 0, 5, "a100-0"}, StagePlan{{1}, 5, 12, "a100-1"}}};
  PipelinePlan b{2, 8, {StagePlan{{2}, 0, 3, "t4-0"}, StagePlan{{3}, 3, 7, "t4-1"}, StagePlan{{4}, 7, 12, "cpu"}}};
  PipelinePlan c{2, 8, {StagePlan{{5}, 0, 12, "mi250"}}};
  p.pipelines = {a, b, c};
  ClusterSpec cl;
  cl.devices = {Device{"a100-0", "eu-1", "cuda", "A100", 40, 1, 312}, Device{"a100-1", "eu-1", "cuda", "A100", 40, 1, 312},
                Device{"t4-0", "us-1", "cuda", "T4", 16, 1, 65},      Device{"t4-1", "us-1", "cuda", "T4", 16, 1, 65},
                Device{"cpu", "us-2", "cpu", "xeon", 64, 0.1, 0},     Device{"mi250", "eu-2", "rocm", "MI250", 64, 1, 0}};
  cl.rules = {LinkRule{"eu-1", "us-1", Link{0.5, 40}}, LinkRule{"us-1", "us-2", Link{25, 0.1}}};
  DiagramInput in{&p, &cl, 12, nullptr};
  std::string d = alloy::viz::to_dot(in);
  std::istringstream lines(d);
  for (std::string line; std::getline(lines, line);)
    if (contains(line, " -> ")) {
      EXPECT_FALSE(contains(line, " label=")) << line;
    }
  EXPECT_TRUE(contains(d, "gradient sync, blocks [3, 5): ranks 0, 3, 5")) << d;
  EXPECT_TRUE(contains(d, "network link eu-1 - us-1: 0.5 Gbit/s, 40 ms")) << d;
  std::string dir = temp_dir();
  if (renders_or_refuses(in, dir + "/dense.png")) {
    alloy::viz::write_diagram(in, dir + "/dense.png");
    EXPECT_EQ(alloy::read_file(dir + "/dense.png").substr(0, 4), "\x89PNG");
  }
  std::filesystem::remove_all(dir);
}

TEST(Diagram, SinglePipelineHasNoSync) {
  Plan p = Plan::data_parallel(4, {{8, 2}});
  DiagramInput in{&p, nullptr, 4, nullptr};
  std::string d = alloy::viz::to_dot(in);
  EXPECT_TRUE(contains(d, "blocks [0, 4) + embedding + head")) << d;
  EXPECT_TRUE(contains(d, "no gradient sync between ranks")) << d;
  EXPECT_FALSE(contains(d, "style=dashed, dir=none")) << d;
}

TEST(Diagram, NullPlanThrows) {
  DiagramInput in;
  EXPECT_THROW(alloy::viz::to_dot(in), alloy::Error);
}

}  // namespace

TEST_F(Fixture, TensorParallelGroupsShowTheirHeadsAndDevices) {
  // Pipeline 1 becomes a tensor-parallel pair: "mid" and "spare" split the heads 3:1.
  plan.pipelines[1].stages[0].ranks = {2, 3};
  plan.pipelines[1].stages[0].tp_split = {3, 1};
  plan.pipelines[1].stages[0].devices = {"mid", "spare"};
  const std::string d = alloy::viz::to_dot(in);
  EXPECT_TRUE(contains(d, "ranks 2, 3</b><br/>tensor parallel x2, heads 3:1: mid + spare")) << d;
  EXPECT_TRUE(contains(alloy::viz::to_mermaid(in), "tensor parallel x2, heads 3:1: mid + spare"));
  // The spare is a member now, not an unused device of its host.
  EXPECT_FALSE(contains(d, "unused")) << d;
}
