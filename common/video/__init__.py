"""Reading and writing video files: finding and probing clips, decoding windows of them,
resizing and cropping a sample's frames, writing videos that browsers play. Module by
module: docs/modules.md."""
