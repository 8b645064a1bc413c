"""sampled_pipeline: cpu ranks sample and gather mini-batches, accelerator ranks train them (the HyScale-GNN /
HitGNN division of labour).

Every step, each trainer's seed slice is sampled by its sampler (cost.GraphCostModel.sampler_of) with the
sampled_dp rule (sampling.build_minibatch, same seeds and hash), so training equals sampled_dp's and one
process's sampled training. A sampler sends step k's batch, then samples step k + 1 while the trainers train
step k (a one-step pipeline; only sampled batches run ahead, never a send without its posted receive).

A batch is four CPU tensors sent in a fixed order on a gloo group of every rank (`PipelineGroups.transfer`):
the header (level sizes, then edge counts per layer), the indices (every layer's local edges, then the
sampled in-degrees), the gathered feature rows and the seeds' labels. Each isend has its irecv posted by the
peer and no tags are used, as NCCL would need. The trainers' gradient all-reduce runs on their own group
(`PipelineGroups.trainers`), created with the world's default backend: on a world initialised with
"cpu:gloo,cuda:nccl" that is NCCL for accelerator tensors while the transfers stay on gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .sampling import InEdges, MiniBatch, build_minibatch, seeds_for_step


@dataclass
class PipelineGroups:
    transfer: object | None  # every rank, gloo: sampler -> trainer batches (CPU tensors)
    trainers: object | None  # the trainer ranks: their gradient all-reduce


def pipeline_groups(trainers: list[int]) -> PipelineGroups:
    """Both groups (collective: every rank calls it, in the same order); None groups in a single process."""
    if not dist.is_initialized():
        return PipelineGroups(None, None)
    return PipelineGroups(dist.new_group(backend="gloo"), dist.new_group(trainers))


@dataclass
class Batch:
    """One trainer's step as its sampler sends it."""

    header: torch.Tensor  # int64: sizes |N_0|..|N_L|, then edges per layer (input order)
    indices: torch.Tensor  # int64: each layer's (2, E_l) local edges flattened, then N_0's sampled in-degrees
    features: torch.Tensor  # x rows of N_0
    labels: torch.Tensor  # target rows of the seeds (N_L, the first rows of N_0)

    def tensors(self) -> list[torch.Tensor]:
        return [self.header, self.indices, self.features, self.labels]

    def minibatch(self, layers: int) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
        """(sizes, per-layer local edges, degrees) unpacked."""
        sizes = [int(v) for v in self.header[:layers + 1]]
        counts = [int(v) for v in self.header[layers + 1:]]
        edges, offset = [], 0
        for e in counts:
            edges.append(self.indices[offset:offset + 2 * e].view(2, e))
            offset += 2 * e
        return sizes, edges, self.indices[offset:]


def make_batch(graph: InEdges, x: torch.Tensor, target: torch.Tensor, seeds: torch.Tensor, layers: int,
               fanout: int, step: int, seed: int) -> Batch:
    """Sample `seeds`' mini-batch of step `step` and gather its features and labels (on the sampler)."""
    mb: MiniBatch = build_minibatch(graph, seeds, layers, fanout, step, seed)
    header = torch.tensor(mb.sizes + [int(e.shape[1]) for e in mb.edges], dtype=torch.long)
    indices = torch.cat([e.reshape(-1) for e in mb.edges] + [mb.degree.long()])
    nodes = mb.nodes.to(x.device)
    return Batch(header, indices, x[nodes].cpu().contiguous(), target[nodes[:seeds.numel()]].cpu().contiguous())


def step_batches(graph: InEdges, x: torch.Tensor, target: torch.Tensor, labelled: torch.Tensor, graph_opts: dict,
                 shares: list[int], fed: list[int], layers: int, step: int) -> dict[int, Batch]:
    """The batches of step `step` for the trainers `fed` (one sampler's), keyed by trainer rank."""
    seed = int(graph_opts.get("seed", 0))
    seeds = seeds_for_step(labelled, int(graph_opts["batch_size"]), step, seed)
    out = {}
    for t in fed:
        lo = sum(shares[:t])
        out[t] = make_batch(graph, x, target, seeds[lo:lo + shares[t]], layers, int(graph_opts["fanout"]), step,
                            seed)
    return out


def send_batches(batches: dict[int, Batch], group: object) -> list:
    """isend every batch to its trainer; the works to wait on (the tensors stay alive in `batches`)."""
    return [dist.isend(t, dst, group=group) for dst, b in batches.items() for t in b.tensors()]


def recv_batch(src: int, layers: int, x: torch.Tensor, target: torch.Tensor, group: object) -> Batch:
    """Receive this trainer's batch from sampler `src`: the header first (it sizes the rest), then the other
    three with their receives posted together (`x`, `target`: the graph's, for widths and dtypes)."""
    header = torch.empty(2 * layers + 1, dtype=torch.long)
    dist.irecv(header, src, group=group).wait()
    sizes, counts = header[:layers + 1].tolist(), header[layers + 1:].tolist()
    indices = torch.empty(2 * sum(counts) + sizes[0], dtype=torch.long)
    feats = torch.empty((sizes[0], *x.shape[1:]), dtype=x.dtype)
    labels = torch.empty((sizes[-1], *target.shape[1:]), dtype=target.dtype)
    works = [dist.irecv(t, src, group=group) for t in (indices, feats, labels)]
    for w in works:
        w.wait()
    return Batch(header, indices, feats, labels)


__all__ = ["Batch", "PipelineGroups", "make_batch", "pipeline_groups", "recv_batch", "send_batches",
           "step_batches"]
