"""Small inline previews of images: the longest side at most 512 px, so a tool result stays far below the
1 MiB some clients (Claude Desktop) cut results at; the full image stays readable as a resource."""

import io
from dataclasses import dataclass

LONGEST = 512


@dataclass
class Thumbnail:
    data: bytes
    mime_type: str
    width: int  # of the original
    height: int


def thumbnail(data: bytes, longest: int = LONGEST) -> Thumbnail:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        image.thumbnail((longest, longest))
        out = io.BytesIO()
        if image.mode in ("RGBA", "LA", "P"):  # keep transparency
            image.save(out, format="PNG", optimize=True)
            mime = "image/png"
        else:
            image.convert("RGB").save(out, format="JPEG", quality=85)
            mime = "image/jpeg"
    return Thumbnail(out.getvalue(), mime, width, height)
