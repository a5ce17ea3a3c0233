"""Reading clip files: which files are clips and why one is refused (``files``), OpenCV's
reader and its seeking (``reader``, with ``pyav_stream`` for the videos OpenCV opens but
decodes no frame of), frames held in memory: the frame cache and image files
(``in_memory``), opening and measuring any clip (``probe``), area resampling (``resize``)
and the crop, resize and flip of a sample's frames (``crop``)."""
