#pragma once
// Diagrams of a Plan on a cluster: who holds which blocks, where activations flow, which ranks
// reduce gradients together, and which network links that traffic crosses. The same picture is
// produced as Graphviz DOT (rendered to SVG/PNG/PDF through libgvc) and as Mermaid text, the
// two formats HeteroShard's visualizer offers, so a user moving from it keeps their workflow.
//
// What is drawn:
//  - with a cluster: one box per host (labelled with its name); each stage is a node inside the
//    box of the host its device lives on. A stage's `device` may name a device or, as plans
//    converted from hetero_config.json do, a host. Stages naming nothing the cluster knows go
//    to an "unplaced" box rather than being guessed onto a device. Devices no stage uses are
//    drawn greyed out, so a device the planner left idle is visible.
//  - without a cluster: one box per pipeline.
//  - each stage node: rank(s), device name and type, blocks "[b, e)" plus "embedding" / "head"
//    where they live, the pipeline's micro-batch size x count, and predicted figures if given.
//  - solid arrows: activations from stage to stage within a pipeline (gradients flow back).
//  - dashed lines: gradient sync between stages of consecutive pipelines that hold common
//    blocks, labelled with the shared block range. Chaining consecutive pipelines connects every
//    sync group without drawing all pairs; the graph's note lists the groups in full.
//  - thick grey lines between host boxes: the network link (bandwidth, latency) for every host
//    pair that one of the edges above crosses, and no other pair.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "alloy/core/plan.h"
#include "alloy/plan/cluster.h"

namespace alloy::viz {

struct DiagramInput {
  const Plan* plan = nullptr;
  const plan::ClusterSpec* cluster = nullptr;  // may be null: group by pipeline instead of host
  // Model blocks; the stage ending here carries the head. <= 0: each pipeline's last stage does.
  int64_t num_layers = 0;
  // Planner predictions to annotate; null = use plan->predicted. Understood members:
  //   step_s                      number, shown in the title
  //   per_stage, memory_bytes     per stage, either a flat array in plan order (pipeline 0's
  //                               stages, then pipeline 1's, ...), an array per pipeline, or an
  //                               object keyed by rank ("0": ...). An entry is a number (seconds,
  //                               resp. bytes) or an object of named numbers (keys ending in
  //                               "_s" are seconds, in "_bytes" bytes).
  // Entries that do not match the plan's shape are reported in the note, not drawn.
  nlohmann::json predicted;
};

std::string to_dot(const DiagramInput& in);      // Graphviz DOT
std::string to_mermaid(const DiagramInput& in);  // Mermaid flowchart

// Writes FILE in the format its extension names: .svg, .png, .pdf (rendered with libgvc's "dot"
// layout), .dot (DOT text) or .mmd (Mermaid). Throws InputError naming FILE for any other
// extension, and Error when Graphviz cannot lay out or render. The file is written atomically.
void write_diagram(const DiagramInput& in, const std::string& file);

// The extensions write_diagram accepts, for help texts: ".svg, .png, .pdf, .dot, .mmd".
std::string diagram_formats();

// Whether this build renders .svg/.png/.pdf itself: false when configured with
// -DALLOY_GRAPHVIZ=OFF (GPU machines often lack libgvc; DOT and Mermaid text need nothing).
bool diagram_renders();

}  // namespace alloy::viz
