"""A reportlab canvas that writes each finished page to the output file at once, so memory stays flat.

reportlab's `PDFDocument` keeps every page (and, at save, the whole file) in memory. Here each page
and its content stream are formatted and written to the output the moment `showPage()` finishes it,
then dropped; only shared objects (fonts, the page tree, catalog, info) are written at `save()`,
followed by a cross-reference table built from a compact array of offsets. What is kept per page is
its object number and a reference in the page tree (tens of bytes), so a 10 000-page report needs
about the memory of a 10-page one.

Drawing is plain reportlab: `canvas.drawString(...)`, `canvas.showPage()`, `canvas.save()`.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any, BinaryIO

from reportlab.pdfbase import pdfdoc
from reportlab.pdfgen.canvas import Canvas


class _Output:
    """Counts and hashes what is written."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.offset = 0
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.out.write(data)
        self.sha256.update(data)
        start = self.offset
        self.offset += len(data)
        return start


class StreamingDocument(pdfdoc.PDFDocument):
    """A PDFDocument whose pages go to `output` as they are added (see the module docstring)."""

    output: _Output
    offsets: array[int]

    def start(self, out: BinaryIO) -> None:
        self.output = _Output(out)
        self.offsets = array("q", [0])
        self.output.write(b"%PDF-1.4\n%\x93\x8c\x8b\x9e\n")

    def _write_object(self, name: str, obj: Any) -> int:
        number = self.idToObjectNumberAndVersion[name][0]
        data = pdfdoc.PDFIndirectObject(name, obj).format(self)
        if len(self.offsets) <= number:
            self.offsets.extend([0] * (number + 1 - len(self.offsets)))
        self.offsets[number] = self.output.write(data)
        return number

    def addPage(self, page: Any) -> None:
        super().addPage(page)
        name = f"Page{self.pageCounter - 1}"
        self._write_object(name, page)  # formatting registers the page's content stream
        contents = page.Contents
        contents_name = contents.__InternalName__
        self._write_object(contents_name, contents)
        for done in (name, contents_name):  # keep only what the page tree and xref need
            number = self.idToObjectNumberAndVersion[done][0]
            del self.idToObject[done], self.numberToId[number]
        del self.idToObjectNumberAndVersion[contents_name]
        doc: Any = self  # reportlab's stubs do not declare the document's internals
        doc.Pages.pages[-1] = pdfdoc.PDFObjectReference(name)

    def SaveToFile(self, filename: Any, canvas: Any) -> None:
        """Write the shared objects, the cross-reference table and the trailer (`filename` is ignored)."""
        doc: Any = self  # reportlab's stubs do not declare the document's internals; as PDFDocument.GetPDFData
        for font in doc.delayedFonts:
            font.addObjects(doc)
        doc.info.invariant = doc.invariant
        doc.info.digest(doc.signature)
        doc.Reference(doc.Catalog)
        doc.Reference(doc.info)
        doc.Outlines.prepare(doc, canvas)
        if doc.Outlines.ready < 0:
            doc.Catalog.Outlines = None
        doc.encrypt.prepare(doc)
        number = 0
        while number < self.objectcounter:  # writing may register more objects; the loop sees them
            number += 1
            name = self.numberToId.get(number)
            if name is not None:
                self._write_object(name, self.idToObject[name])
        count = self.objectcounter + 1
        self.offsets.extend([0] * (count - len(self.offsets)))
        xref = self.output.write(f"xref\n0 {count}\n0000000000 65535 f \n".encode())
        for start in range(1, count, 4096):
            chunk = self.offsets[start : min(count, start + 4096)]
            self.output.write("".join(f"{off:010d} 00000 n \n" for off in chunk).encode())
        trailer = pdfdoc.PDFTrailer(
            startxref=xref, Size=count, Root=doc.Reference(doc.Catalog), Info=doc.Reference(doc.info), ID=doc.ID()
        )
        self.output.write(trailer.format(self))


class StreamingCanvas(Canvas):
    """A reportlab Canvas writing to `out` page by page. `pages`, `bytes` and `sha256` are set after `save()`."""

    def __init__(self, out: BinaryIO, **kwargs: Any) -> None:
        super().__init__(out, **kwargs)
        doc: Any = getattr(self, "_doc")  # noqa: B009 - not in reportlab's stubs
        doc.__class__ = StreamingDocument  # same state, streaming behaviour
        assert isinstance(doc, StreamingDocument)  # noqa: S101 - narrows the type for mypy
        doc.start(out)
        self.stream_doc = doc

    @property
    def pages(self) -> int:
        return int(self.stream_doc.pageCounter) - 1

    @property
    def bytes_written(self) -> int:
        return self.stream_doc.output.offset

    @property
    def sha256(self) -> str:
        return self.stream_doc.output.sha256.hexdigest()
