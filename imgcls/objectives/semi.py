"""Semi-supervised training, the `semi` objective: FixMatch (Sohn et al. 2020) and FlexMatch (Zhang et al. 2021)
over `data.unlabeled` (data/unlabeled.py: the stream, its two views).

Each micro-batch takes `semi.ratio` (mu) unlabelled images per labelled one from the objective's own stream; one
forward runs the labelled batch, the weak views and the strong views together (BatchNorm sees all three, as in
FixMatch). The weak view's prediction, without gradient, becomes the pseudo-label where it is confident; the strong
view learns it by cross-entropy: loss = labelled loss + semi.weight x mean over the unlabelled images of
mask x CE(strong, pseudo-label) (the mean over every unlabelled image, masked or not, as FixMatch).

Confident: FixMatch, the top probability >= semi.threshold (tau). FlexMatch, >= T(c) = tau x M(beta(c)) for the
predicted class c, with beta(c) = sigma(c) / max(max_c' sigma(c'), images never pseudo-labelled) (the warm-up;
without it / max sigma), sigma(c) the unlabelled images whose latest prediction above tau was c, and the convex
mapping M(x) = x / (2 - x). The state is one class index per unlabelled image (-1: none yet), int32.
`semi.dist_align`: the weak probabilities are divided by their running mean (momentum 0.999) and renormalised
before thresholding (a uniform target).

The pseudo-labels come from the trained model's own forward on the weak view, not from the EMA: it costs no
second forward, and the EMA (decay 0.9998 by default) trails far behind early in training, when pseudo-labels
matter most; the EMA is validated and saved in best.pt as in any run.

Under DDP each process takes its share of the stream (the world's batches are one process's at world x the batch);
the weak predictions of every process are gathered once per micro-batch, so the class-wise state, the alignment's
mean and the logged sums are the same on every process and equal to one process's. The state (the stream's
position, the class indices, the running mean, the sums) is part of last.pt: a resumed run continues bitwise."""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

import imgcls.compute.distributed as dist_utils
from imgcls.compute.device import DeviceInput, pin_memory_for
from imgcls.core.errors import BadDataError, ConfigError
from imgcls.data.loaders import shutdown_workers
from imgcls.data.unlabeled import build_unlabeled_loader, check_unlabeled, unlabeled_digest
from imgcls.objectives.base import Objective
from imgcls.tasks import task_of

log = logging.getLogger(__name__)


ALIGN_MOMENTUM = 0.999


class ClassThresholds:
    """FlexMatch's learning status: one class index per unlabelled image (-1: never above tau)."""

    def __init__(self, n: int, num_classes: int, warmup: bool, device: torch.device):
        self.labels = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.num_classes, self.warmup = num_classes, warmup

    def thresholds(self, tau: float) -> torch.Tensor:
        counts = torch.bincount(self.labels.long() + 1, minlength=self.num_classes + 1).float()
        sigma, unused = counts[1:], counts[0]
        denominator = torch.maximum(sigma.max(), unused) if self.warmup else sigma.max()
        beta = sigma / denominator.clamp_min(1.0)
        return tau * beta / (2.0 - beta)

    def update(self, indices: torch.Tensor, predictions: torch.Tensor, above_tau: torch.Tensor) -> None:
        """The images above tau take their prediction; an image twice in the batch (a round's end and the next
        one's start) takes its later one, on any device (a plain indexed write of repeated indices is not
        deterministic on CUDA)."""
        indices, predictions = indices[above_tau], predictions[above_tau]
        unique, inverse = torch.unique(indices, return_inverse=True)
        order = torch.arange(indices.numel(), device=indices.device)
        last = torch.full((unique.numel(),), -1, dtype=order.dtype, device=indices.device)
        last = last.scatter_reduce(0, inverse, order, reduce="amax")
        self.labels[unique] = predictions[last].int()


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's `tensor`, concatenated in rank order (the tensor itself in one process)."""
    if not dist_utils.is_initialized():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


class SemiSupervised(Objective):
    name = "semi"

    def __init__(self, criterion: torch.nn.Module, cfg, paths: list[str], source: str, num_classes: int,
                 device: torch.device, rank: int = 0, world_size: int = 1, classes: Optional[list[str]] = None):
        super().__init__(criterion)
        self.classes = classes
        s, d = cfg.semi, cfg.data
        self.method, self.tau, self.weight, self.ratio = s.method, s.threshold, s.weight, s.ratio
        self.cfg, self.paths, self.num_classes = cfg, paths, num_classes
        self.rank, self.world_size, self.device = rank, world_size, device
        self.identity = {"method": s.method, "images": len(paths), "sha256": unlabeled_digest(paths, source)}
        self.input = DeviceInput.from_config(cfg, device, None)
        self.flex = ClassThresholds(len(paths), num_classes, s.warmup, device) if s.method == "flexmatch" else None
        self.p_model = torch.full((num_classes,), 1.0 / num_classes, device=device) if s.dist_align else None
        self.batches_taken = 0
        self.unreadable: set[int] = set()
        # images seen, images above their threshold, then the pseudo-labels per class: since the last log line
        self.sums = torch.zeros(2 + num_classes, dtype=torch.float64, device=device)
        self.totals = torch.zeros(2 + num_classes, dtype=torch.float64)  # the run's, on the host
        self.loader, self.batches = None, None
        self.pin_memory = pin_memory_for(d.pin_memory, device)

    # ------------------------------------------------------------ the stream

    def next_unlabeled(self, labelled: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next (weak, strong, image indices) of `ratio` x `labelled` images, normalised on the device."""
        if self.batches is not None and self.loader.batch_size != self.ratio * labelled:
            self.close()  # the batch finder tries another batch size: a new stream for it
        if self.batches is None:
            self.loader = build_unlabeled_loader(self.cfg.data, self.paths, self.cfg.train.seed, self.ratio * labelled,
                                                 self.rank, self.world_size, self.batches_taken, self.pin_memory)
            self.batches = iter(self.loader)
        weak, strong, indices, replaced = next(self.batches)
        self.batches_taken += 1
        self.note_unreadable(replaced)
        return self.input.prepare(weak), self.input.prepare(strong), indices.to(self.device, non_blocking=True)

    def note_unreadable(self, replaced: torch.Tensor) -> None:
        new = set(replaced[replaced >= 0].tolist()) - self.unreadable  # a host tensor from the loader: no sync
        if not new:
            return
        self.unreadable |= new
        log.warning("data.unlabeled: %d unreadable file(s) replaced by others: %s", len(new),
                    ", ".join(self.paths[i] for i in sorted(new)[:10]))
        limit = self.cfg.data.max_bad_fraction
        if len(self.unreadable) > limit * len(self.paths):
            raise BadDataError(f"data.unlabeled: {len(self.unreadable)} of {len(self.paths)} files cannot be read, "
                               f"more than data.max_bad_fraction={limit}: "
                               + ", ".join(self.paths[i] for i in sorted(self.unreadable)[:20]))

    def close(self) -> None:
        if self.loader is not None:
            shutdown_workers(self.loader)
            self.batches = None

    # ------------------------------------------------------------ the loss

    def __call__(self, model: torch.nn.Module, images: torch.Tensor,
                 targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        n = images.shape[0]
        weak, strong, indices = self.next_unlabeled(n)
        logits = model(torch.cat([images, weak, strong]))
        u = weak.shape[0]
        labelled_loss = self.criterion(logits[:n], targets)
        pseudo, mask = self.pseudo_labels(logits[n:n + u].detach().float(), indices)
        per_image = F.cross_entropy(logits[n + u:].float(), pseudo, reduction="none")
        unlabelled_loss = (per_image * mask).mean()
        return labelled_loss + self.weight * unlabelled_loss, {}

    def pseudo_labels(self, weak_logits: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pseudo-labels, float mask) of this process's weak views; the state and sums move by every process's."""
        probs = weak_logits.softmax(dim=1)
        everyone = gathered(probs)
        if self.p_model is not None:
            self.p_model.mul_(ALIGN_MOMENTUM).add_(everyone.mean(0), alpha=1.0 - ALIGN_MOMENTUM)
            probs = aligned(probs, self.p_model)
            everyone = aligned(everyone, self.p_model)
        confidence, pseudo = probs.max(dim=1)
        all_confidence, all_pseudo = everyone.max(dim=1)
        if self.flex is None:
            mask, all_mask = confidence >= self.tau, all_confidence >= self.tau
        else:
            thresholds = self.flex.thresholds(self.tau)
            mask, all_mask = confidence >= thresholds[pseudo], all_confidence >= thresholds[all_pseudo]
            self.flex.update(gathered(indices), all_pseudo, all_confidence >= self.tau)
        self.sums[0] += all_mask.numel()
        self.sums[1] += all_mask.sum()
        self.sums[2:] += torch.bincount(all_pseudo[all_mask], minlength=self.num_classes).double()
        return pseudo, mask.float()

    # ------------------------------------------------------------ figures

    def interval_logs(self) -> dict:
        """The share of unlabelled images above their threshold since the last line, and the pseudo-labels' class
        spread (every process's images; the same figures on each)."""
        sums = self.sums.cpu().clone()  # .cpu() of a CPU tensor is the tensor itself
        self.sums.zero_()
        self.totals += sums
        seen, above = int(sums[0]), int(sums[1])
        if not seen:
            return {}
        spread = ", ".join(f"{self.class_name(c)} {int(k)}" for c, k in enumerate(sums[2:].tolist()) if k)
        log.info("semi: %d of %d unlabelled images (%.0f%%) above the threshold; pseudo-labels: %s", above, seen,
                 100.0 * above / seen, spread or "none")
        return {"train/unlabeled_above_threshold": above / seen}

    def class_name(self, c: int) -> str:
        return self.classes[c] if self.classes else str(c)

    def summary(self) -> dict:
        """summary.json's `semi`: the unlabelled set and the run's share above threshold and class spread."""
        seen, above = int(self.totals[0]), int(self.totals[1])
        return {"semi": {**self.identity, "threshold": self.tau, "unlabeled_seen": seen,
                         "above_threshold": above, "above_threshold_share": above / seen if seen else None,
                         "pseudo_labels": {self.class_name(c): int(k) for c, k in enumerate(self.totals[2:].tolist())},
                         "unreadable": len(self.unreadable)}}

    # ------------------------------------------------------------ last.pt

    def state_dict(self) -> dict:
        record = {**self.identity, "batches_taken": self.batches_taken, "sums": self.sums.cpu().clone(),
                  "totals": self.totals.clone(), "unreadable": sorted(self.unreadable)}
        if self.flex is not None:
            record["class_of_image"] = self.flex.labels.cpu().clone()
        if self.p_model is not None:
            record["p_model"] = self.p_model.cpu().clone()
        return record

    def load_state_dict(self, record: dict) -> None:
        self.batches_taken = int(record["batches_taken"])
        self.sums.copy_(record["sums"])
        self.totals.copy_(record["totals"])
        self.unreadable = set(record.get("unreadable", []))
        if self.flex is not None:
            self.flex.labels.copy_(record["class_of_image"])
        if self.p_model is not None:
            self.p_model.copy_(record["p_model"])

    def check_resume(self, ckpt: dict) -> None:
        saved = ckpt.get("semi")
        if not isinstance(saved, dict):
            raise ConfigError(f"--resume: the checkpoint was trained without unlabelled images; semi.method="
                              f"{self.method} would be another training (start a new run)")
        if saved.get("method") != self.method:
            raise ConfigError(f"--resume: the checkpoint was trained with semi.method={saved.get('method')}; resume "
                              f"with it, or start a new run")
        if (saved.get("images"), saved.get("sha256")) != (self.identity["images"], self.identity["sha256"]):
            raise ConfigError(f"--resume: data.unlabeled holds other files than the checkpoint's run read "
                              f"({self.identity['images']} now, {saved.get('images')} then); resume with the same "
                              f"unlabelled images, or start a new run")


def aligned(probs: torch.Tensor, p_model: torch.Tensor) -> torch.Tensor:
    """Distribution alignment to a uniform target: p / p_model, renormalised."""
    probs = probs / p_model.clamp_min(1e-6)
    return probs / probs.sum(dim=1, keepdim=True)


def check_no_semi(ckpt: dict) -> None:
    """--resume without semi.method: a semi-supervised run continues only as one (ConfigError, exit 2)."""
    saved = ckpt.get("semi")
    if isinstance(saved, dict):
        raise ConfigError(f"--resume: the checkpoint was trained with semi.method={saved.get('method')} on "
                          f"{saved.get('images')} unlabelled images; set semi.method and data.unlabeled to continue it")


def check_semi(cfg) -> list[str]:
    """Before any work (exit 2): a single-label task, and unlabelled images that can be read."""
    task_of(cfg).check_supported("semi.method")
    return check_unlabeled(cfg.data)


def build_semi(cfg, classes: Optional[list[str]], model: torch.nn.Module, device: torch.device) -> SemiSupervised:
    """The run's semi-supervised objective (call when `semi.method` is not none). `classes` None: a step's cost is
    being measured (the batch finder): the same objective, on the real unlabelled images."""
    paths = check_semi(cfg)
    num_classes = len(classes) if classes is not None else model_outputs(model)
    rank, world = ((torch.distributed.get_rank(), torch.distributed.get_world_size())
                   if dist_utils.is_initialized() else (0, 1))
    objective = SemiSupervised(task_of(cfg).criterion(cfg.train), cfg, paths, cfg.data.unlabeled, num_classes,
                               device, rank, world, classes)
    if classes is not None:
        log.info("semi: %s on %d unlabelled images from %s, %d per labelled image, threshold %g, weight %g%s",
                 cfg.semi.method, len(paths), cfg.data.unlabeled, cfg.semi.ratio, cfg.semi.threshold, cfg.semi.weight,
                 ", distribution alignment" if cfg.semi.dist_align else "")
    return objective


def model_outputs(model: torch.nn.Module) -> int:
    head = getattr(model, "num_classes", None)
    if isinstance(head, int) and head > 0:
        return head
    return int(list(model.parameters())[-1].shape[0])
