"""torch's own file formats, read and written without torch: `torch.save` archives and DCP's `.metadata`.

Trust model: a checkpoint is data, never code. Nothing in a file runs, and nothing it names is imported:
a pickle may name only the globals of an allow-list (`pickles.SAFE_GLOBALS`; in `.metadata`, DCP's records),
any other is refused by name; those become stand-ins that only remember their names (`pickles`), and a
few are built for real (`argparse.Namespace`, `collections.OrderedDict`; in `.metadata`, DCP's records as
plain records and torch's dtypes as their names). A storage is only noted where it lies in its file until
its bytes are asked for. `screen` reads a checkpoint's every pickle so before torch loads any of them, and
an archive is read only where torch's own reader cannot read it otherwise (`zip_reader`): what is screened
is what torch loads.

  pickles         the stand-ins, and the unpickler and pickler that read and write them
  zip_structs     the zip records (headers, directory entries, end records) as the reader and writer spell them
  zip_reader      a `torch.save` archive's records, found as torch finds them: any other layout is refused
  archive_reader  `torch.save` archives read: the pickle as stand-ins, a tensor's region by `pread`
  payloads        the pickles inside pickles (TE's `_extra_state`, a BytesIO), read through the allow-list
  archive_writer  `torch.save` archives written from our buffers (no clone; Zip64)
  dcp_metadata    DCP's `.metadata`, read through its allow-list and written as DCP pickles it
  screen          every pickle of a checkpoint read through the allow-list, before torch or Megatron-Core loads it
"""

import pickle
import struct
import zipfile
import zlib

# What reading a damaged or foreign file raises: all that "the checkpoint is damaged" may stand for.
# Anything else (an AttributeError, a TypeError) is a bug of ours and must surface as one, so the parsers
# raise only these for what a file holds: `pickles.Unpickler.load` turns what the pickle machine itself
# raises applying the file's opcodes into an UnpicklingError, and values taken from what a pickle built
# are checked (`pickles.nonnegative_ints`, `dcp_metadata._field`) before they are used.
PARSE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, struct.error, zipfile.BadZipFile, zlib.error)
