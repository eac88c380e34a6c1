"""Embodiments and sizes of robot-action requests, plain Python (request validation and the client read them
without torch); each equal to diffusers 0.42.1's `Cosmos3OmniPipeline` ("P", `pipeline_cosmos3_omni.py`).

- `MODES`: policy (frame 0 clean, actions generated), forward dynamics (frame 0 and the given actions clean, video
  generated), inverse dynamics (the whole clip clean, actions generated).
- `DOMAIN_IDS`: embodiment → row of the domain-aware linears (P:227-245); `RAW_ACTION_DIMS`: its raw action width
  (P:263-279; a domain without one is refused, as the pipeline refuses it).
- `RESOLUTION_BINS`: tier → aspect → canvas (H, W) (P:187-216).
- `ActionGeometry.of(src_h, src_w, tier, spatial)`: the sizes the pipeline derives for a conditioning image or clip
  of src_h × src_w pixels: frames stretched down to multiples of `spatial` (the VAE's 16), the tier's canvas nearest
  their aspect, the content downscaled (never up) into it, the latent grid cropped to the content (P:704-761,
  1496-1507). The canvas is what the prompt states and what is encoded; the video is the content's latent grid.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DOMAIN_IDS",
    "FORWARD",
    "INVERSE",
    "MODES",
    "POLICY",
    "RAW_ACTION_DIMS",
    "RESOLUTION_BINS",
    "ActionGeometry",
]

POLICY, FORWARD, INVERSE = "policy", "forward_dynamics", "inverse_dynamics"
MODES = (POLICY, FORWARD, INVERSE)

# (H, W) canvases per tier, keyed by their aspect H/W as the pipeline writes it; order matters for ties (min's first)
RESOLUTION_BINS: dict[int, dict[str, tuple[int, int]]] = {
    256: {"1.0": (256, 256), "0.8": (256, 320), "1.25": (320, 256), "0.6": (192, 320), "1.6666666666666667": (320, 192)},
    480: {"1.0": (640, 640), "0.7391304347826086": (544, 736), "1.3529411764705883": (736, 544),
          "0.5769230769230769": (480, 832), "1.7333333333333334": (832, 480)},
    704: {"1.0": (960, 960), "0.7647058823529411": (832, 1088), "1.3076923076923077": (1088, 832),
          "0.55": (704, 1280), "1.8181818181818181": (1280, 704)},
    720: {"1.0": (960, 960), "0.7536231884057971": (832, 1104), "1.3269230769230769": (1104, 832),
          "0.5625": (720, 1280), "1.7777777777777777": (1280, 720)},
}  # fmt: skip

DOMAIN_IDS: dict[str, int] = {
    "no_action": 0, "av": 1, "camera_pose": 2, "hand_pose": 3, "pusht": 4, "libero": 5, "umi": 6,
    "bridge_orig_lerobot": 7, "droid_lerobot": 8, "robomind-franka": 8, "galbot": 9, "robomind-franka-dual": 12,
    "robomind-ur": 13, "agibotworld": 15, "agibot_gear_gripper": 15, "agibot_gear_gripper_ext": 15, "fractal": 20,
}  # fmt: skip

RAW_ACTION_DIMS: dict[str, int] = {
    "av": 9, "camera_pose": 9, "pusht": 2, "umi": 10, "bridge_orig_lerobot": 10, "droid_lerobot": 10,
    "robomind-franka": 10, "robomind-franka-dual": 20, "robomind-ur": 10, "galbot": 30, "agibotworld": 29,
    "agibot_gear_gripper": 29, "agibot_gear_gripper_ext": 29, "fractal": 10, "hand_pose": 57,
}  # fmt: skip


@dataclass(frozen=True)
class ActionGeometry:
    """Pixel and latent sizes of an action request, (height, width) each."""

    frame: tuple[int, int]  # the source stretched down to multiples of the VAE's spatial factor
    canvas: tuple[int, int]  # the tier's bin nearest the frame's aspect: what is encoded and what the prompt says
    content: tuple[int, int]  # the frame downscaled into the canvas (top-left); the rest is padding
    latent: tuple[int, int]  # the latent grid kept: the content's, at least 1 × 1

    @classmethod
    def of(cls, src_h: int, src_w: int, tier: int, spatial: int) -> ActionGeometry:
        fh, fw = src_h - src_h % spatial, src_w - src_w % spatial  # VaeImageProcessor.get_default_height_width
        if fh < 1 or fw < 1:
            raise ValueError(f"a {src_h}x{src_w} frame is smaller than {spatial}x{spatial}")
        bins = RESOLUTION_BINS[tier]
        aspect = float(fh / fw)  # VideoProcessor.classify_height_width_bin
        th, tw = bins[min(bins, key=lambda r: abs(float(r) - aspect))]
        scale = min(tw / fw, th / fh, 1.0)  # downscale only
        ch, cw = max(1, int(scale * fh + 0.5)), max(1, int(scale * fw + 0.5))
        return cls((fh, fw), (th, tw), (ch, cw), (max(ch // spatial, 1), max(cw // spatial, 1)))
