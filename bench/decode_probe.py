"""Wan2.2 VAE decode at Edge's video shape: frame-by-frame (reference) vs channels_last_3d vs multi-frame chunks.

python -m bench.decode_probe   (CUDA)
"""

from __future__ import annotations

import time

import torch

from cosmos3_core.checkpoint import Checkpoint
from cosmos3_core.conditioning import StreamDecoder, VaeCodec
from cosmos3_core.deployment import resolve_checkpoint


@torch.inference_mode()
def decode_multi(dec: StreamDecoder, latents: torch.Tensor) -> torch.Tensor:
    """The next latent frames of a stream in ONE decoder call (valid after the first frame: the causal convs see
    the same inputs with the cache; only the first frame's temporal upsampling is special)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    c, vae = dec.codec, dec.codec.vae
    z = latents.to(device=c.device, dtype=c.dtype)
    x = vae.post_quant_conv(z / c.inv_std.to(z.device) + c.mean.to(z.device))
    video = unpatchify(
        vae.decoder(x, feat_cache=dec.cache, feat_idx=[0], first_chunk=False), patch_size=vae.config.patch_size
    )
    frames = (video.clamp(-1.0, 1.0).float()[0].permute(1, 2, 3, 0) * 0.5 + 0.5).clamp(0, 1)
    return (frames * 255).round().to(torch.uint8).cpu()


def timed(fn, repeat=2):
    fn()
    ts = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return out, min(ts)


def main() -> None:
    torch.backends.cudnn.benchmark = True
    ckpt = Checkpoint.open(resolve_checkpoint("random:edge"))
    codec = VaeCodec(ckpt.load_vae("cuda", torch.bfloat16))
    lat = torch.randn(1, 48, 31, 30, 52, generator=torch.Generator().manual_seed(0)).cuda()
    ref, t_ref = timed(lambda: StreamDecoder(codec).decode(lat))
    print(f"frame-by-frame NCDHW      {t_ref:6.2f} s  {tuple(ref.shape)}")

    def chunked(k: int):
        dec = StreamDecoder(codec)
        outs = [dec.decode(lat[:, :, :1])]
        for a in range(1, lat.shape[2], k):
            outs.append(decode_multi(dec, lat[:, :, a : a + k]))
        return torch.cat(outs)

    for k in (2, 4, 8):
        out, t = timed(lambda k=k: chunked(k))
        diff = (out.int() - ref.int()).abs()
        print(
            f"chunks of {k} latent frames {t:6.2f} s  max|diff| {diff.max().item()}  mean {diff.float().mean().item():.4f}"
        )
    for m in codec.vae.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.to(memory_format=torch.channels_last_3d)
    out, t = timed(lambda: StreamDecoder(codec).decode(lat))
    print(f"channels_last_3d          {t:6.2f} s  max|diff| {(out.int() - ref.int()).abs().max().item()}")
    out, t = timed(lambda: chunked(4))
    print(f"channels_last_3d chunks 4 {t:6.2f} s  max|diff| {(out.int() - ref.int()).abs().max().item()}")


if __name__ == "__main__":
    main()
