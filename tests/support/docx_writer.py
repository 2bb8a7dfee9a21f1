"""DOCX files with what Word writes beyond plain runs, for the extraction tests.

python-docx builds the package (content types, relationships, styles) and saves it; the WordprocessingML it
has no API for (tracked changes, content controls, fields, text boxes, notes) is added as raw XML, in the
shape Word itself writes it. `REVISED` lists the texts a reader of the document sees, `HIDDEN` the texts in
the file a reader does not see (deleted, field codes, placeholders).
"""

from __future__ import annotations

import io

import docx
from docx.opc.constants import CONTENT_TYPE, RELATIONSHIP_TYPE
from docx.opc.packuri import PackURI
from docx.opc.part import Part
from docx.oxml import parse_xml

W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
_NAMESPACES = (
    f'xmlns:w="{W}" '
    'xmlns:mc="http://schemas.openxmlformats.org/markup-compatibility/2006" '
    'xmlns:wp="http://schemas.openxmlformats.org/drawingml/2006/wordprocessingDrawing" '
    'xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main" '
    'xmlns:wps="http://schemas.microsoft.com/office/word/2010/wordprocessingShape" '
    'xmlns:v="urn:schemas-microsoft-com:vml"'
)

REVISED = {
    "kept": "The board met on Tuesday",
    "inserted": "and approved the night budget",
    "control": "Client: Northwind Traders",
    "inline_control": "Harbour Street 12",
    "field": "Page 7 of 9",
    "text_box": "Pull quote: the quiet hours pay for the day.",
    "footnote": "Minutes kept by the treasurer, second draft.",
    "endnote": "Figures are rounded to the nearest hundred.",
}
HIDDEN = {
    "deleted": "and rejected the morning plan",
    "moved_away": "an old sentence moved elsewhere",
    "field_code": "NUMPAGES",
    "placeholder": "Click or tap here to enter text.",
}


def revised_docx() -> bytes:
    """A DOCX holding every text of REVISED and HIDDEN, each in the markup Word uses for it."""
    document = docx.Document()
    body = document.element.body
    sections = body[-1]  # w:sectPr stays last
    for xml in _body_xml():
        sections.addprevious(parse_xml(xml))
    part = document.part
    for name, reltype, content_type, note in (
        ("footnotes", RELATIONSHIP_TYPE.FOOTNOTES, CONTENT_TYPE.WML_FOOTNOTES, "footnote"),
        ("endnotes", RELATIONSHIP_TYPE.ENDNOTES, CONTENT_TYPE.WML_ENDNOTES, "endnote"),
    ):
        blob = _notes_xml(name, note, REVISED[note]).encode()
        part.relate_to(Part(PackURI(f"/word/{name}.xml"), content_type, blob, part.package), reltype)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def _body_xml() -> list[str]:
    run = '<w:r><w:t xml:space="preserve">{}</w:t></w:r>'.format
    text_box = (
        "<w:r><mc:AlternateContent>"
        '<mc:Choice Requires="wps"><w:drawing><wp:anchor><a:graphic><a:graphicData>'
        f"<wps:wsp><wps:txbx><w:txbxContent><w:p>{run(REVISED['text_box'])}</w:p></w:txbxContent></wps:txbx>"
        "</wps:wsp></a:graphicData></a:graphic></wp:anchor></w:drawing></mc:Choice>"
        "<mc:Fallback><w:pict><v:shape><v:textbox>"
        f"<w:txbxContent><w:p>{run(REVISED['text_box'])}</w:p></w:txbxContent>"
        "</v:textbox></v:shape></w:pict></mc:Fallback>"
        "</mc:AlternateContent></w:r>"
    )
    return [
        f"<w:p {_NAMESPACES}>{run(REVISED['kept'] + ' ')}"
        f'<w:ins w:id="1" w:author="Ada" w:date="2025-01-07T09:00:00Z">{run(REVISED["inserted"])}</w:ins>'
        f'<w:del w:id="2" w:author="Ada" w:date="2025-01-07T09:00:00Z"><w:r><w:delText xml:space="preserve">'
        f"{HIDDEN['deleted']}</w:delText></w:r></w:del>{run('.')}"
        f'<w:r><w:footnoteReference w:id="1"/></w:r></w:p>',
        f'<w:p {_NAMESPACES}><w:moveFrom w:id="3" w:author="Ada">{run(HIDDEN["moved_away"])}</w:moveFrom>'
        f'{text_box}{run("See the note.")}<w:r><w:endnoteReference w:id="1"/></w:r></w:p>',
        f'<w:sdt {_NAMESPACES}><w:sdtPr><w:alias w:val="Client"/><w:id w:val="11"/></w:sdtPr>'
        f"<w:sdtContent><w:p>{run(REVISED['control'])}</w:p></w:sdtContent></w:sdt>",
        f'<w:p {_NAMESPACES}>{run("Office: ")}<w:sdt><w:sdtPr><w:id w:val="12"/></w:sdtPr>'
        f"<w:sdtContent>{run(REVISED['inline_control'])}</w:sdtContent></w:sdt></w:p>",
        f'<w:sdt {_NAMESPACES}><w:sdtPr><w:id w:val="13"/><w:showingPlcHdr/></w:sdtPr>'
        f"<w:sdtContent><w:p>{run(HIDDEN['placeholder'])}</w:p></w:sdtContent></w:sdt>",
        f'<w:p {_NAMESPACES}><w:r><w:fldChar w:fldCharType="begin"/></w:r>'
        f'<w:r><w:instrText xml:space="preserve"> {HIDDEN["field_code"]} </w:instrText></w:r>'
        f'<w:r><w:fldChar w:fldCharType="separate"/></w:r>{run(REVISED["field"])}'
        f'<w:r><w:fldChar w:fldCharType="end"/></w:r></w:p>',
    ]


def _notes_xml(root: str, note: str, text: str) -> str:
    """A notes part as Word writes it: the two separator notes, then one note of `text`."""
    separators = "".join(
        f'<w:{note} w:type="{kind}" w:id="{number}"><w:p><w:r><w:{kind}/></w:r></w:p></w:{note}>'
        for number, kind in ((-1, "separator"), (0, "continuationSeparator"))
    )
    return (
        f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n<w:{root} xmlns:w="{W}">{separators}'
        f'<w:{note} w:id="1"><w:p><w:r><w:t>{text}</w:t></w:r></w:p></w:{note}></w:{root}>'
    )
