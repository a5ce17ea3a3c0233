"""Reading and writing video files: which files are clips and why one is refused (``files``),
OpenCV's reader and its seeking (``reader``, with ``pyav_stream`` for the videos OpenCV
opens but decodes no frame of), frames held in memory: the frame cache and image files
(``in_memory``), opening and measuring any clip (``probe``, which counts H.264/HEVC frames
from packets with ``packet_count``), area resampling (``resize``), the crop, resize and
flip of a sample's frames (``crop``) and writing videos that browsers play (``writer``)."""
